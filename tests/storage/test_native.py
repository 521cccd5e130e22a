"""The native data path (storage/backends/native.py): checkpoint payload bytes through obstore
on S3 (moto) and Azure (Azurite), the control path on fsspec; the client built from the same
storage_options; turned off by ``native=False`` or ``ZEPHON_NATIVE=0``; one policy of
retries; errors as the fsspec path gives them; one client per process."""

from __future__ import annotations

import logging
import re
import threading
import uuid

import pytest
import torch

from tests.conftest import random_payload
from tests.faults import FaultProxy
from tests.s3_calls import S3Calls
from zephon import dcp as zd
from zephon.storage import (
    BackendUnavailableError,
    CheckpointStore,
    CorruptCheckpointError,
    RetryPolicy,
)
from zephon.storage.backends.native import ENVIRONMENT, native_client
from zephon.storage.backends.translate import (
    NativeConnectionError,
    NativeReplyError,
    native_error,
)
from zephon.storage.retry import is_throttling, is_transient, reply_status

PART = 5 << 20
QUICK = RetryPolicy(max_attempts=3, deadline_s=20, base_backoff_s=0.01, max_backoff_s=0.05)


class Operations(S3Calls):
    """The S3 operations s3fs sends, with the key each names."""

    def __init__(self, fs) -> None:
        super().__init__(fs)
        self.seen: list[tuple[str, str]] = []

    def on_call(self, model, params) -> None:
        self.seen.append((model.name, params.get("url_path", "")))

    def naming(self, name: str) -> list[str]:
        return [op for op, path in self.seen if path.split("?")[0].endswith(f"/{name}")]


def save_files(store: CheckpointStore, step: int, files: dict[str, bytes], streamed: bytes):
    with store.run("r").begin(step) as writer:
        for name, data in files.items():
            writer.write_bytes(name, memoryview(data))
        with writer.open("streamed.bin") as out:
            out.write(streamed)
        writer.commit()


@pytest.fixture(params=["s3", "azure"])
def object_store(request, tmp_path):
    return request.getfixturevalue(f"{request.param}_backend")


def test_payload_bytes_go_native_and_round_trip_exactly(object_store):
    files = {
        "empty.bin": b"",
        "one.bin": b"x",
        "below-a-part.bin": random_payload(PART - 1),
        "parts.bin": random_payload(2 * PART + 7),
    }
    streamed = random_payload(2 * PART + 3)
    with object_store.open_store(part_size=PART) as store:
        native = store.location.backend.native
        assert native is not None
        save_files(store, 1, files, streamed)
        assert native.calls["put"] >= 3 and native.calls["put_multipart"] == 1
        assert native.calls["open_write"] == 1
        reader = store.run("r").reader(1)
        for name, data in files.items():
            assert reader.read_bytes(name) == data
        assert reader.read_bytes("streamed.bin") == streamed
        into = bytearray(PART + 11)
        assert reader.read_range_into("parts.bin", PART - 5, into) == len(into)
        assert bytes(into) == files["parts.bin"][PART - 5 : 2 * PART + 6]
        tail = bytearray(100)
        assert reader.read_range_into("one.bin", 0, tail) == 1 and tail[:1] == b"x"
        assert native.calls["get_range"] >= 2
        assert store.run("r").verify(1, deep=True).ok


def test_on_s3_the_payload_never_passes_through_s3fs_but_the_marker_does(s3_backend):
    with s3_backend.open_store(part_size=PART) as store, Operations(store.location.fs) as ops:
        save_files(store, 1, {"a.bin": random_payload(3 * PART)}, b"streamed")
        assert store.run("r").reader(1).read_bytes("a.bin")
    assert ops.naming("a.bin") == [] and ops.naming("streamed.bin") == []
    assert "PutObject" in ops.naming("_COMMIT")  # the create-only PUT stays on fsspec


@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_turned_off_native_path_sends_the_payload_through_s3fs(s3_backend, monkeypatch, how):
    options = dict(s3_backend.storage_options)
    if how == "option":
        options["native"] = False
    else:
        monkeypatch.setenv(ENVIRONMENT, "0")
    with CheckpointStore(s3_backend.url, options, part_size=PART) as store:
        assert store.location.backend.native is None
        with Operations(store.location.fs) as ops:
            save_files(store, 1, {"a.bin": b"abc"}, b"streamed")
            assert store.run("r").reader(1).read_bytes("a.bin") == b"abc"
    assert ops.naming("a.bin") == ["PutObject", "GetObject"]


def test_an_option_it_cannot_map_keeps_fsspec_and_says_why(s3_backend, caplog):
    caplog.set_level(logging.DEBUG, logger="zephon.storage.native")
    options = {**s3_backend.storage_options, "s3_additional_kwargs": {"StorageClass": "STANDARD"}}
    with CheckpointStore(s3_backend.url, options) as store:
        assert store.location.backend.native is None
        save_files(store, 1, {"a.bin": b"abc"}, b"")
        assert store.run("r").reader(1).read_bytes("a.bin") == b"abc"
    assert any(
        "s3_additional_kwargs.StorageClass has no native equivalent" in r.getMessage()
        for r in caplog.records
    )


def test_gcs_stays_on_fsspec_unless_asked(tmp_path):
    assert native_client("gs", {"token": "anon"}, "bucket", QUICK) is None


def test_one_client_per_bucket_and_options_in_a_process(s3_backend):
    clients = []

    def open_one() -> None:
        with s3_backend.open_store() as store:
            clients.append((store.location.backend.native, store.location.fs))

    threads = [threading.Thread(target=open_one) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    open_one()
    assert len({id(native) for native, _ in clients}) == 1
    assert len({id(fs) for _, fs in clients}) == 1  # and one s3fs filesystem


def test_a_corrupted_object_is_caught_by_its_crc32c(s3_backend):
    data = random_payload(PART + 5)
    with s3_backend.open_store(part_size=PART) as store:
        save_files(store, 1, {"a.bin": data}, b"")
        reader = store.run("r").reader(1)
        damaged = bytearray(data)
        damaged[PART] ^= 0xFF
        store.location.fs.pipe_file(f"{reader.path}/a.bin", bytes(damaged))
        with pytest.raises(CorruptCheckpointError, match="crc32c"):
            reader.read_bytes("a.bin")


def test_a_corrupted_dcp_shard_fails_the_load(s3_backend):
    state = {"w": torch.arange(1 << 18, dtype=torch.float32), "b": torch.ones(7)}
    with s3_backend.open_store() as store:
        writer = zd.attach_ranks(store, "r", 1, store.run("r").begin(1))
        zd.save(state, zd.ZephonStorageWriter(writer, thread_count=1))
        target = {name: torch.zeros_like(t) for name, t in state.items()}
        zd.load(target, zd.ZephonStorageReader(store, "r", 1))
        assert all(torch.equal(state[n], target[n]) for n in state)
        assert store.location.backend.native.calls["get_range"] >= 1
        reader = store.run("r").reader(1)
        shard = next(n for n in reader.names if n.endswith(".distcp"))
        path = f"{reader.path}/{shard}"
        body = bytearray(store.location.fs.cat_file(path))
        body[len(body) // 2] ^= 0x01  # inside the large tensor's bytes
        store.location.fs.pipe_file(path, bytes(body))
        with pytest.raises(CorruptCheckpointError):
            zd.load(target, zd.ZephonStorageReader(store, "r", 1))


@pytest.fixture
def proxied(s3):
    bucket = f"zt-native-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(bucket)
    with FaultProxy(s3.endpoint_url, seed=3) as proxy:
        options = {**s3.storage_options(), "client_kwargs": {"endpoint_url": proxy.url}}
        with CheckpointStore(f"s3://{bucket}/ckpt", options, retry=QUICK, part_size=PART) as store:
            yield store, proxy


def gets(proxy: FaultProxy, name: str) -> list[str]:
    return [r.outcome for r in proxy.log if r.method == "GET" and r.path.endswith(f"/{name}")]


def test_a_failing_read_is_tried_by_zephons_policy_alone(proxied):
    store, proxy = proxied
    assert store.location.backend.native is not None
    save_files(store, 1, {"a.bin": b"abc"}, b"")
    reader = store.run("r").reader(1)
    proxy.fail(method="GET", path=r"/a\.bin$", status=503, count=2)
    assert reader.read_bytes("a.bin") == b"abc"
    assert gets(proxy, "a.bin") == ["fail", "fail", "ok"]
    proxy.fail(method="GET", path=r"/a\.bin$", status=500, count=10)
    with pytest.raises(BackendUnavailableError, match=r"after 3 attempts"):
        reader.read_range("a.bin", 0, 2)
    # three tries of the policy, none of obstore's own in between
    assert gets(proxy, "a.bin")[3:] == ["fail"] * 3


def test_a_refusal_is_asked_once_and_named_as_credentials(proxied):
    store, proxy = proxied
    save_files(store, 1, {"a.bin": b"abc"}, b"")
    reader = store.run("r").reader(1)
    proxy.fail(method="GET", path=r"/a\.bin$", status=403, count=5)
    with pytest.raises(BackendUnavailableError, match="credentials") as caught:
        reader.read_bytes("a.bin")
    assert gets(proxy, "a.bin") == ["fail"]
    assert "\n" not in str(caught.value)


def test_a_missing_object_is_file_not_found(s3_backend):
    with s3_backend.open_store() as store:
        backend = store.location.backend
        with pytest.raises(FileNotFoundError):
            backend.read_range(f"{store.location.root}/nothing", 0, 4)
        with pytest.raises(FileNotFoundError):
            backend.read_range_into(f"{store.location.root}/nothing", 0, bytearray(4))


def test_obstore_errors_become_what_the_policy_and_translation_read():
    from obstore.exceptions import GenericError, NotFoundError, PermissionDeniedError

    assert isinstance(native_error(NotFoundError("gone\nmore")), FileNotFoundError)
    assert isinstance(native_error(PermissionDeniedError("no")), PermissionError)
    slow = native_error(
        GenericError(
            "Server returned non-2xx status code: 503 Service Unavailable: "
            "<Error><Code>SlowDown</Code></Error>"
        )
    )
    assert isinstance(slow, NativeReplyError)
    assert is_transient(slow) and is_throttling(slow) and reply_status(slow) == 503
    refused = native_error(GenericError("Server returned non-2xx status code: 400 Bad Request"))
    assert not is_transient(refused) and reply_status(refused) == 400
    cut = native_error(GenericError("error sending request: connection reset by peer"))
    assert isinstance(cut, NativeConnectionError) and is_transient(cut)
    assert re.match(r"^[^\n]*$", str(native_error(NotFoundError("a\nb"))))


def test_a_large_slice_lands_in_the_tensor_in_bounded_ranges_and_neighbours_share_one(
    s3_backend,
):
    mib = 1 << 20
    state = {f"small{i}": torch.full((256,), float(i)) for i in range(8)}  # 1 KiB each
    state["big"] = torch.randn(1 << 20)  # 4 MiB
    with s3_backend.open_store() as store:
        writer = zd.attach_ranks(store, "r", 1, store.run("r").begin(1))
        zd.save(state, zd.ZephonStorageWriter(writer, thread_count=1))
        native = store.location.backend.native
        seen: list[tuple[str, int, int]] = []
        native.observers.append(lambda *request: seen.append(request))
        target = {name: torch.zeros_like(t) for name, t in state.items()}
        zd.load(target, zd.ZephonStorageReader(store, "r", 1, max_request_bytes=mib))
        native.observers.clear()
    assert all(torch.equal(state[n], target[n]) for n in state)
    shard = [(start, end) for key, start, end in seen if key.endswith(".distcp")]
    assert all(end - start <= mib for start, end in shard)
    big = [r for r in shard if r[1] - r[0] == mib]
    assert len(big) == 4  # the 4 MiB tensor, in four GETs of one MiB
    assert len(shard) == 5  # and the eight small ones in one


def test_a_forked_child_reads_through_fsspec(s3_backend):
    import multiprocessing

    with s3_backend.open_store() as store:
        save_files(store, 1, {"a.bin": b"from the parent"}, b"")
        parent = store.location.backend.native
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)

        def child() -> None:  # forked: nothing is pickled
            # a store of its own, as with fsspec, whose filesystems are not fork-safe either
            with s3_backend.open_store() as own:
                data = own.run("r").reader(1).read_bytes("a.bin")
                send.send((data, own.location.backend.native))

        process = context.Process(target=child)
        process.start()
        assert receive.poll(60)
        got = receive.recv()
        process.join(30)
        assert got == (b"from the parent", None)
        assert store.location.backend.native is parent


class Headers(S3Calls):
    """The checksum headers of every PutObject and UploadPart s3fs sends."""

    def __init__(self, fs) -> None:
        super().__init__(fs)
        self.sent: list[tuple[str, set[str]]] = []

    def on_call(self, model, params) -> None:
        if model.name in {"PutObject", "UploadPart"}:
            names = {k.lower() for k in params.get("headers", {}) if "checksum" in k.lower()}
            self.sent.append((model.name, names))


def test_on_s3fs_our_crc32c_goes_with_a_put_and_botocore_adds_none_of_its_own(s3_backend):
    options = {**s3_backend.storage_options, "native": False}
    data = random_payload(3 * PART)
    with CheckpointStore(s3_backend.url, options, part_size=PART) as store:
        with Headers(store.location.fs) as seen, store.run("r").begin(1) as writer:
            writer.write_bytes("small.bin", memoryview(b"abc"))
            writer.write_bytes("parts.bin", data)
            writer.commit()
        reader = store.run("r").reader(1)
        assert reader.read_bytes("small.bin") == b"abc" and reader.read_bytes("parts.bin") == data
    puts = [names for op, names in seen.sent if op == "PutObject"]
    parts = [names for op, names in seen.sent if op == "UploadPart"]
    assert {"x-amz-checksum-crc32c"} in puts  # small.bin, which S3 checks
    assert len(parts) == 3 and all(names == set() for names in parts)  # no CRC32 of botocore's


def test_anonymous_gcs_stays_on_fsspec_even_when_asked(caplog):
    """obstore 0.12's GCS client asks the metadata server for a token before every upload,
    even with skip_signature: an anonymous store would fail its writes on the native path."""
    caplog.set_level(logging.DEBUG, logger="zephon.storage.native")
    options = {"token": "anon", "native": True, "endpoint_url": "http://127.0.0.1:1"}
    assert native_client("gs", options, "bucket", QUICK) is None
    assert any("token='anon'" in r.getMessage() for r in caplog.records)
