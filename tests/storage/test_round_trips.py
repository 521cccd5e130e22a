"""Fewer sequential round trips, same rules: ``begin`` probes the fence and the marker at once,
``commit`` lists the payload and re-checks the fence at once, with its last files' uploads
(``commit(files=...)``), and writes the marker only after all of it passed; uploads run 32 at
once on a pool with room for the checks beside them, and a user's pool size is kept.

The request-level tests run on moto's S3 server behind ``benchmarks/latency_proxy.py``, which
counts the requests and how many were under way at once; they assert counts and order, never
times. The rule tests run on every backend.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from zephon.storage import (
    CheckpointStore,
    FencedOutError,
    WriteAbortedError,
    new_save_id,
)
from zephon.storage.backends.object_store import UPLOAD_WORKERS
from zephon.storage.location import DEFAULT_POOL_CONNECTIONS, with_defaults
from zephon.storage.store import LOCAL_WORKERS, REMOTE_WORKERS

#: long enough that requests sent together are under way together on a loaded machine
HOLD_MS = 1000


def _proxy_class():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "latency_proxy.py")
    spec = importlib.util.spec_from_file_location("latency_proxy", os.path.abspath(path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LatencyProxy


LatencyProxy = _proxy_class()


@pytest.fixture
def store(backend):
    with backend.open_store() as s:
        yield s


def start(store: CheckpointStore, run: str, resumed_from: int | None = None):
    fence = store.run(run).claim_attempt(after=store.run(run).lineage())
    return store.run(run).decide_resume(fence, resumed_from)


@pytest.fixture
def proxied(s3, request):
    """A store on a fresh bucket of moto's S3 reached through a proxy, and the proxy; a test
    calls ``measure(proxy)`` right before what it measures."""
    bucket = f"zt-rt-{os.urandom(6).hex()}"
    s3.create_bucket(bucket)
    with LatencyProxy(s3.endpoint_url, 0) as proxy:
        options = {**s3.storage_options(), "client_kwargs": {"endpoint_url": proxy.url}}
        options.update(getattr(request, "param", {}))
        with CheckpointStore(f"s3://{bucket}/ckpt", options) as store:
            yield store, proxy


def measure(proxy) -> None:
    """Count from here, each request held ``HOLD_MS`` back (so that requests sent together are
    seen under way together)."""
    proxy.delay_ms = HOLD_MS
    proxy.reset()


def kinds(proxy) -> list[str]:
    """The proxy's requests as ``LIST <prefix>``, ``GET <key>``, ``PUT <key>`` (key paths
    without the bucket)."""
    out = []
    for line in proxy.request_lines:
        method, _, target = line.partition(" ")
        path, _, query = target.partition("?")
        key = path.split("/", 2)[2] if path.count("/") >= 2 else ""
        if method == "GET" and "list-type=" in query:
            prefix = next((q[7:] for q in query.split("&") if q.startswith("prefix=")), "")
            out.append(f"LIST {prefix.replace('%2F', '/')}")
        else:
            out.append(f"{method} {key}")
    return out


# -- requests on the wire (S3) -------------------------------------------------------------------


def test_begin_sends_the_fence_check_and_the_marker_probe_together(proxied):
    store, proxy = proxied
    fence = start(store, "r")
    measure(proxy)
    writer = store.run("r").begin(7, fence=fence)
    sent = kinds(proxy)
    assert sorted(k.split()[0] for k in sent) == ["GET", "LIST"], sent
    assert any(k.endswith("_attempts/") for k in sent) and any("_COMMIT" in k for k in sent)
    assert proxy.peak_in_flight == 2  # at once, not one after the other
    writer.abort()


def test_commit_lists_payload_and_fence_together_then_puts_the_marker_last(proxied):
    store, proxy = proxied
    fence = start(store, "r")
    writer = store.run("r").begin(7, fence=fence)
    writer.write_bytes("a.bin", b"a")
    measure(proxy)
    writer.commit()
    sent = kinds(proxy)
    assert len(sent) == 3, sent
    assert sorted(sent[:2]) == sorted(
        [f"LIST ckpt/r/save-7/{writer.save_id}/", "LIST ckpt/r/_attempts/"]
    )
    assert sent[2] == "PUT ckpt/r/save-7/_COMMIT"
    assert proxy.peak_in_flight == 2


def test_the_last_files_go_out_with_the_fence_check_and_only_the_marker_follows(proxied):
    store, proxy = proxied
    fence = start(store, "r")
    writer = store.run("r").begin(7, fence=fence)
    files = {f"f{i:02d}": b"x" * i for i in range(32)}
    measure(proxy)
    writer.commit(files=files)
    sent = kinds(proxy)
    assert len(sent) == 34, sent  # no payload listing: nothing was written before
    assert sorted(sent[:33]) == sorted(
        ["LIST ckpt/r/_attempts/", *(f"PUT ckpt/r/save-7/{writer.save_id}/{n}" for n in files)]
    )
    assert sent[33] == "PUT ckpt/r/save-7/_COMMIT"
    assert proxy.peak_in_flight == 33  # the fence check did not wait for a free connection
    assert proxy.longest_chain == 2


def test_a_commit_of_32_files_is_three_round_trips(proxied):
    """``begin`` (fence + marker probe), the uploads with the fence re-check, the marker."""
    store, proxy = proxied
    fence = start(store, "r")
    chains = []
    # The chain is the code's; a loaded machine can only lengthen it (a wave of 33 requests
    # that takes the client over HOLD_MS to send). The shortest of two saves is the code's:
    # the old commit (uploads, then listing and fence check, then marker) is 4 every time.
    for step in (3, 4):
        measure(proxy)
        with store.run("r").begin(step, fence=fence) as writer:
            writer.commit(files={f"f{i:02d}": b"y" * 64 for i in range(32)})
        assert proxy.requests == 2 + 32 + 1 + 1
        chains.append(proxy.longest_chain)
        proxy.delay_ms = 0
        assert store.run("r").verify(step, deep=True).ok
        if chains[-1] <= 3:
            break
    assert min(chains) <= 3, chains


def test_files_written_before_the_last_ones_are_listed_beside_them(proxied):
    store, proxy = proxied
    fence = start(store, "r")
    writer = store.run("r").begin(7, fence=fence)
    writer.write_bytes("early.bin", b"early")
    measure(proxy)
    manifest = writer.commit(files={"late.bin": b"late"})
    sent = kinds(proxy)
    payload = f"ckpt/r/save-7/{writer.save_id}/"
    assert sorted(sent[:3]) == sorted(
        [f"LIST {payload}", "LIST ckpt/r/_attempts/", f"PUT {payload}late.bin"]
    )
    assert sent[3:] == ["PUT ckpt/r/save-7/_COMMIT"]
    assert proxy.peak_in_flight == 3
    assert [f.name for f in manifest.files] == ["early.bin", "late.bin"]


def test_thirty_two_files_upload_at_once_on_the_default_pool(proxied):
    store, proxy = proxied
    assert store.max_workers == REMOTE_WORKERS == UPLOAD_WORKERS == 32
    fence = start(store, "r")
    writer = store.run("r").begin(1, fence=fence)
    measure(proxy)
    writer.write_many({f"f{i:02d}": b"x" * i for i in range(32)})
    assert proxy.requests == 32
    assert proxy.peak_in_flight == 32  # aiobotocore's own pool of 10 would allow 10
    writer.commit()


@pytest.mark.parametrize("proxied", [{"config_kwargs": {"max_pool_connections": 4}}], indirect=True)
def test_a_users_pool_size_is_kept(proxied):
    store, proxy = proxied
    fs = store.location.fs
    fs.connect()
    assert fs.s3.meta.config.max_pool_connections == 4
    writer = store.run("r").begin(1)
    measure(proxy)
    writer.write_many({f"f{i:02d}": b"x" for i in range(8)})
    assert 1 < proxy.peak_in_flight <= 4
    writer.abort()


# -- the pool default on the real s3fs object ----------------------------------------------------


def _pool_of(store: CheckpointStore) -> int:
    fs = store.location.fs
    fs.connect()
    return fs.s3.meta.config.max_pool_connections


def test_s3_gets_a_pool_with_room_beside_a_wave_and_other_config_is_kept(s3):
    options = {**s3.storage_options(), "config_kwargs": {"connect_timeout": 7}}
    with CheckpointStore("s3://zt-pool/a", options) as store:
        assert _pool_of(store) == DEFAULT_POOL_CONNECTIONS == UPLOAD_WORKERS + 8 == 40
        assert store.location.fs.s3.meta.config.connect_timeout == 7
    assert options["config_kwargs"] == {"connect_timeout": 7}  # the caller's dict untouched


def test_a_pool_size_from_fsspecs_configuration_is_kept(s3, monkeypatch):
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"max_pool_connections": 3}})
    with CheckpointStore("s3://zt-pool/b", s3.storage_options()) as store:
        assert _pool_of(store) == 3


def test_a_botocore_config_object_is_left_alone():
    from botocore.config import Config

    options = {"client_kwargs": {"config": Config(max_pool_connections=5)}}
    assert with_defaults("s3", options) == options
    assert with_defaults("file", {}) == {}
    assert with_defaults("s3a", {})["config_kwargs"] == {
        "max_pool_connections": 40,
        "retries": {"total_max_attempts": 1},  # Zephon's policy retries, not botocore
        # Zephon's CRC32C covers the bytes: no CRC32 of botocore's own
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
    }


def test_thread_defaults_per_backend(tmp_path):
    assert CheckpointStore(str(tmp_path)).max_workers == LOCAL_WORKERS
    assert CheckpointStore("memory://zt-workers").max_workers == REMOTE_WORKERS
    assert CheckpointStore(str(tmp_path), max_workers=3).max_workers == 3
    with pytest.raises(ValueError, match="max_workers=0"):
        CheckpointStore(str(tmp_path), max_workers=0)


def test_gcs_needs_no_pool_setting(gcs):
    """gcsfs's aiohttp connector already allows more than 32 connections."""
    gcs.create_bucket("zt-gcs-pool")
    with CheckpointStore("gs://zt-gcs-pool/a", gcs.storage_options()) as store:
        store.run("r").lineage()  # any request opens the session
        assert store.location.fs.session.connector.limit >= 32


# -- the rules still hold (every backend) --------------------------------------------------------


def test_a_stale_begin_leaves_the_marker_alone(store):
    """The marker probe runs beside the fence check, but nothing is superseded unless the
    fence passed: a damaged marker stays as it is for the current attempt to judge."""
    old = start(store, "r")
    with store.run("r").begin(3, fence=old) as writer:
        writer.write_bytes("w", b"w")
        writer.commit()
    damaged = b"{not json"
    store.location.fs.pipe_file(store.run("r").marker_path(3), damaged)
    start(store, "r")
    with pytest.raises(FencedOutError):
        store.run("r").begin(3, fence=old)
    assert store.run("r").marker_bytes(3) == damaged
    assert store.run("r").condemned() == []


def test_a_commit_missing_a_file_and_fenced_out_refuses_and_writes_no_marker(store):
    old = start(store, "r")
    writer = store.run("r").begin(4, fence=old)
    writer.write_many({"kept": b"k", "gone": b"g"})
    store.location.fs.rm_file(f"{writer.payload_path}/gone")
    start(store, "r")
    with pytest.raises(WriteAbortedError, match="gone: missing"):
        writer.commit()  # the missing file is named first, the fence refuses as well
    assert not store.run("r").is_committed(4)


def test_a_commit_fenced_out_after_begin_writes_no_marker(store):
    old = start(store, "r")
    writer = store.run("r").begin(5, fence=old)
    writer.write_many({f"f{i}": b"x" for i in range(8)})
    new = start(store, "r")
    with pytest.raises(FencedOutError) as caught:
        writer.commit()
    assert caught.value.current.epoch == new.epoch
    assert not store.run("r").is_committed(5)
    assert store.run("r").marker_bytes(5) is None


def test_begin_keeps_what_attached_writers_wrote_before_it(store):
    """A save id chosen in advance: other processes may attach and write before the primary
    begins, so begin never lists or removes anything in its payload directory."""
    fence = start(store, "r")
    save_id = new_save_id(fence)
    early = store.run("r").attach(6, save_id=save_id, fence=fence)
    early.write_bytes("rank1.bin", b"one")
    primary = store.run("r").begin(6, fence=fence, save_id=save_id)
    primary.write_bytes("rank0.bin", b"zero")
    primary.add_entries(early.entries)
    manifest = primary.commit()
    assert [f.name for f in manifest.files] == ["rank0.bin", "rank1.bin"]
    assert store.run("r").verify(6, deep=True).ok


def test_an_uncommitted_save_under_an_id_is_gcs_to_remove(store):
    """What an earlier, uncommitted try left in a payload directory is an orphan for gc, not
    something a later begin cleans up."""
    fence = start(store, "r")
    crashed = store.run("r").begin(8, fence=fence)
    crashed.write_bytes("old.bin", b"old")
    with store.run("r").begin(8, fence=fence) as writer:
        writer.write_bytes("new.bin", b"new")
        manifest = writer.commit()
    assert [o.save_id for o in store.orphans(0, runs=["r"])] == [crashed.save_id]
    assert manifest.save_id != crashed.save_id


def test_a_commit_fenced_out_while_its_last_files_upload_writes_no_marker(store):
    old = start(store, "r")
    writer = store.run("r").begin(5, fence=old)
    start(store, "r")
    with pytest.raises(FencedOutError):
        writer.commit(files={"last.bin": b"l"})
    assert store.run("r").marker_bytes(5) is None
    writer.abort()
    assert store.orphans(0, runs=["r"]) == []


def test_a_commit_with_last_files_still_refuses_a_missing_earlier_file(store):
    writer = store.run("r").begin(4, fence=start(store, "r"))
    writer.write_many({"kept": b"k", "gone": b"g"})
    store.location.fs.rm_file(f"{writer.payload_path}/gone")
    with pytest.raises(WriteAbortedError, match="gone: missing"):
        writer.commit(files={"last.bin": b"l"})
    assert not store.run("r").is_committed(4)


class _Broken:
    def read(self, size: int = -1) -> bytes:
        raise OSError("the source disk went away")


def test_a_last_file_that_fails_leaves_no_marker(store):
    writer = store.run("r").begin(6, fence=start(store, "r"))
    with pytest.raises(OSError, match="went away"):
        writer.commit(files={"ok.bin": b"ok", "bad.bin": _Broken()})
    assert store.run("r").marker_bytes(6) is None
    writer.abort()
    assert not store.run("r").is_committed(6)


def test_the_marker_carries_the_copies_asked_for_within_the_limit(store):
    from zephon.storage.manifest import MAX_INLINE_BYTES

    big = os.urandom(MAX_INLINE_BYTES + 1)  # does not compress
    with store.run("r").begin(2, fence=start(store, "r")) as writer:
        writer.commit(
            files={"meta.json": b'{"a": 1}', "big.bin": big, "other": b"o"},
            inline=["meta.json", "big.bin"],
        )
    manifest = store.run("r").read_manifest(2)
    assert set(manifest.inline) == {"meta.json"}  # big.bin passes the limit: not copied
    assert manifest.inline_bytes("meta.json") == b'{"a": 1}'
    assert manifest.inline_bytes("other") is None and manifest.inline_bytes("big.bin") is None
    assert store.run("r").verify(2, deep=True).ok


def test_a_copy_that_does_not_match_its_entry_is_not_used_and_a_stray_one_is_corrupt():
    import json

    from zephon.storage import CorruptCheckpointError
    from zephon.storage.checksum import crc32c_of
    from zephon.storage.manifest import FileEntry, Manifest, inline_copy

    entry = FileEntry("m.json", 4, crc32c_of(b"good"))
    made = Manifest(run="r", step=1, save_id="s", files=(entry,), payload="s")
    for copy in (b"evil", b"good!", b"good"):
        body = json.loads(made.to_json())
        body["inline"] = {"m.json": inline_copy(copy)}
        parsed = Manifest.from_json(json.dumps(body).encode(), where="m")
        assert parsed.inline_bytes("m.json") == (copy if copy == b"good" else None)
    assert "inline" not in json.loads(made.to_json())  # markers without copies are unchanged
    assert parsed.checksum() == made.checksum()  # as a version without copies computes it
    body["inline"] = {"m.json": "not base64!"}
    assert Manifest.from_json(json.dumps(body).encode(), where="m").inline_bytes("m.json") is None
    body["inline"] = {"other.json": inline_copy(b"good")}
    with pytest.raises(CorruptCheckpointError, match="does not list"):
        Manifest.from_json(json.dumps(body).encode(), where="m")


def test_inline_naming_a_file_not_passed_is_refused_before_anything_goes_out(store):
    from zephon.storage import InvalidArgumentError

    writer = store.run("r").begin(3, fence=start(store, "r"))
    with pytest.raises(InvalidArgumentError, match=r"inline names 'meta.json', not among"):
        writer.commit(files={"a.bin": b"a"}, inline=["meta.json"])
    assert writer.entries == []
    writer.commit(files={"a.bin": b"a"})  # still open
    assert store.run("r").is_committed(3)
