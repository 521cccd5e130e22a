"""Create-only writes whose reply was lost: the server applied the request, the client never
heard. On S3 (moto) through ``tests.faults.FaultProxy.drop_reply``, with the client retrying by
itself (it then gets 412 for its own object) and without (the error of unknown outcome reaches
Zephon); on local disk with the link's result lost in front of the real file system.

The rule under test (docs/fencing.md, "Lost replies"): a create-only write is settled by
reading back, and the writer's own bytes there mean success; payload that a marker may name is
never deleted.
"""

from __future__ import annotations

import pytest
import s3fs

from tests.conftest import Backend
from tests.faults import FaultProxy
from zephon.storage import NO_RETRY, BackendUnavailableError, CheckpointStore, RetryPolicy

MARKER = r"/save-\d+/_COMMIT$"
#: replies dropped per scripted fault: aiohttp resends an idempotent request (a PUT) once by
#: itself when a reused connection breaks, so the second reply is dropped too for the error to
#: reach the client's own retries (or, without them, Zephon)
DROPS = 2
FILES = {"weights.bin": b"w" * 70_000, "optim/state.bin": b"o" * 1_000}


@pytest.fixture(params=["client retries", "no client retries"])
def client_retries(request, monkeypatch) -> bool:
    """Whether s3fs and botocore retry a failed request themselves: they then resend the
    create-only PUT and get 412 for its own object; without, the reset reaches Zephon."""
    retries = request.param == "client retries"
    if not retries:
        monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    return retries


@pytest.fixture
def proxy(s3):
    with FaultProxy(s3.endpoint_url, seed=7) as opened:
        yield opened


def through(backend: Backend, proxy: FaultProxy, client_retries: bool) -> dict:
    """``backend``'s storage options with every request sent through ``proxy``."""
    options = {**backend.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}
    if not client_retries:
        options["config_kwargs"] = {"retries": {"total_max_attempts": 1}}
    return options


def start(store: CheckpointStore, run: str = "r", resumed_from: int | None = None):
    fence = store.run(run).claim_attempt(after=store.run(run).lineage())
    return store.run(run).decide_resume(fence, resumed_from)


def payload_of(store: CheckpointStore, writer) -> set[str]:
    prefix = f"{writer.payload_path}/"
    return {f.path[len(prefix) :] for f in store.location.backend.list_files(writer.payload_path)}


def assert_complete(store: CheckpointStore, run: str, step: int, save_id: str) -> None:
    """The checkpoint is the latest, its marker names ``save_id`` and every byte verifies."""
    manifest = store.run(run).latest()
    assert manifest is not None and (manifest.step, manifest.save_id) == (step, save_id)
    assert store.run(run).verify(step, deep=True).ok
    reader = store.run(run).reader(step)
    assert {name: reader.read_bytes(name) for name in FILES} == FILES


def test_a_commit_whose_marker_reply_was_lost_has_committed(s3_backend, proxy, client_retries):
    with CheckpointStore(s3_backend.url, through(s3_backend, proxy, client_retries)) as store:
        fence = start(store)
        with store.run("r").begin(5, fence=fence) as writer:
            writer.write_many(FILES)
            proxy.drop_reply(method="PUT", path=MARKER, count=DROPS)
            manifest = writer.commit()
        assert proxy.outcomes("drop_reply") and proxy.pending_rules == 0
        writer.abort()  # a committed save is never removed
        assert manifest.save_id == writer.save_id
        assert payload_of(store, writer) == set(FILES)
    with s3_backend.open_store() as direct:
        assert direct.run("r").read_manifest(5) == manifest
        assert_complete(direct, "r", 5, writer.save_id)


def test_an_unfenced_commit_whose_marker_reply_was_lost_has_committed(
    s3_backend, proxy, client_retries
):
    options = through(s3_backend, proxy, client_retries)
    with CheckpointStore(s3_backend.url, options) as store, store.run(None).begin(3) as writer:
        writer.write_many(FILES)
        proxy.drop_reply(method="PUT", path=MARKER, count=DROPS)
        writer.commit()
    with s3_backend.open_store() as direct:
        assert_complete(direct, None, 3, writer.save_id)


def test_an_attempt_record_whose_reply_was_lost_is_the_attempts_own(
    s3_backend, proxy, client_retries
):
    with CheckpointStore(s3_backend.url, through(s3_backend, proxy, client_retries)) as store:
        proxy.drop_reply(method="PUT", path=r"/_attempts/\d+\.json$", count=DROPS)
        fence = store.run("r").claim_attempt(after=store.run("r").lineage())
        assert proxy.pending_rules == 0
        assert fence.epoch == 1
        assert store.run("r").lineage().current == fence.record


def test_a_decision_record_whose_reply_was_lost_is_the_attempts_own(
    s3_backend, proxy, client_retries
):
    with CheckpointStore(s3_backend.url, through(s3_backend, proxy, client_retries)) as store:
        first = start(store)
        with store.run("r").begin(4, fence=first) as writer:
            writer.write_many(FILES)
            writer.commit()
        claimed = store.run("r").claim_attempt(after=store.run("r").lineage())
        proxy.drop_reply(method="PUT", path=r"/_attempts/\d+\.resume\.json$", count=DROPS)
        fence = store.run("r").decide_resume(claimed, 4)
        assert proxy.pending_rules == 0
        assert (fence.epoch, fence.record.resumed_from) == (2, 4)
        assert store.run("r").lineage().current == fence.record


def test_a_condemnation_record_whose_reply_was_lost_is_written(s3_backend, proxy, client_retries):
    with CheckpointStore(s3_backend.url, through(s3_backend, proxy, client_retries)) as store:
        with store.run("r").begin(2, fence=start(store)) as writer:
            writer.write_many(FILES)
            manifest = writer.commit()
        proxy.drop_reply(method="PUT", path=r"/_CORRUPT\.", count=DROPS)
        store.run("r").condemn(2, manifest, "a test says so")
        assert proxy.pending_rules == 0
        assert store.run("r").is_condemned(2, manifest.save_id)


def unreachable_after_the_marker(proxy: FaultProxy, times: int = 20) -> None:
    """The marker PUT is applied but no answer about it ever comes back: every create's reply
    is lost and every read of the marker fails (500)."""
    proxy.drop_reply(method="PUT", path=MARKER, count=times)
    proxy.fail(method="GET", path=r"/save-\d+/_COMMIT", status=500, count=times)


def test_a_commit_of_unknown_outcome_keeps_its_payload_and_the_marker_names_it(
    s3_backend, proxy, monkeypatch
):
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    # the backend's retry policy off: it would ride out these faults, and the test needs the
    # marker's outcome to stay unknown
    with CheckpointStore(
        s3_backend.url, through(s3_backend, proxy, False), retry=NO_RETRY
    ) as store:
        fence = start(store)
        writer = store.run("r").begin(6, fence=fence)
        writer.write_many(FILES)
        unreachable_after_the_marker(proxy)
        with pytest.raises(BackendUnavailableError, match="was created is unknown"):
            writer.commit()
        writer.abort()  # the marker may name the payload: abort keeps it
        proxy.clear()
        assert payload_of(store, writer) == set(FILES)
    with s3_backend.open_store() as direct:
        assert_complete(direct, "r", 6, writer.save_id)
        assert direct.orphans(0, runs=["r"]) == []  # gc leaves what the marker names


def test_committing_again_settles_a_commit_of_unknown_outcome(s3_backend, proxy, monkeypatch):
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    # the backend's retry policy off: it would ride out these faults, and the test needs the
    # marker's outcome to stay unknown
    with CheckpointStore(
        s3_backend.url, through(s3_backend, proxy, False), retry=NO_RETRY
    ) as store:
        writer = store.run("r").begin(7, fence=start(store))
        writer.write_many(FILES)
        unreachable_after_the_marker(proxy)
        with pytest.raises(BackendUnavailableError):
            writer.commit()
        proxy.clear()
        manifest = writer.commit()
        assert manifest.save_id == writer.save_id and writer.manifest == manifest
        assert_complete(store, "r", 7, writer.save_id)


def test_a_marker_that_never_landed_leaves_the_payload_to_gc(s3_backend, proxy, monkeypatch):
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    # the backend's retry policy off: it would ride out these faults, and the test needs the
    # marker's outcome to stay unknown
    with CheckpointStore(
        s3_backend.url, through(s3_backend, proxy, False), retry=NO_RETRY
    ) as store:
        writer = store.run("r").begin(8, fence=start(store))
        writer.write_many(FILES)
        proxy.fail(method="PUT", path=MARKER, status=500, count=20)  # never forwarded
        with pytest.raises(BackendUnavailableError, match="was created is unknown"):
            writer.commit()
        writer.abort()
        proxy.clear()
        assert payload_of(store, writer) == set(FILES)
        assert not store.run("r").is_committed(8)
        (orphan,) = store.orphans(0, runs=["r"])
        assert (orphan.step, orphan.save_id) == (8, writer.save_id)
        store.remove_orphan(orphan)
        assert payload_of(store, writer) == set()


# -- local disk: the link's result lost in front of the real file system ----------------------


def lose_results(monkeypatch, store: CheckpointStore, *, reads_fail: int = 0) -> None:
    """Every marker create on ``store``'s disk is done, then reported as a reset connection
    (its result lost); the first ``reads_fail`` reads of a marker fail the same way."""
    backend = store.location.backend
    create, read = backend._create_exclusive, backend._read_small
    failing = {"reads": reads_fail}

    def create_then_lose(path: str, data: bytes) -> None:
        create(path, data)
        if path.endswith("/_COMMIT"):
            raise ConnectionResetError(f"lost the result of creating {path}")

    def read_or_fail(path: str) -> bytes:
        if path.endswith("/_COMMIT") and failing["reads"] > 0:
            failing["reads"] -= 1
            raise ConnectionResetError(f"lost the reply reading {path}")
        return read(path)

    # beneath the backend's translation of errors, with its retry policy off (it would ride
    # out these faults, as on S3 above)
    monkeypatch.setattr(backend, "_create_exclusive", create_then_lose)
    monkeypatch.setattr(backend, "_read_small", read_or_fail)
    monkeypatch.setattr(backend, "retry", NO_RETRY)


def test_a_local_commit_whose_result_was_lost_has_committed(local_backend, monkeypatch):
    with local_backend.open_store() as store:
        with store.run("r").begin(1, fence=start(store)) as writer:
            writer.write_many(FILES)
            lose_results(monkeypatch, store)
            writer.commit()
        monkeypatch.undo()
        assert_complete(store, "r", 1, writer.save_id)


def test_a_local_commit_committed_twice_finds_its_own_marker(local_backend, monkeypatch):
    with local_backend.open_store() as store:
        writer = store.run("r").begin(2, fence=start(store))
        writer.write_many(FILES)
        lose_results(monkeypatch, store, reads_fail=100)
        with pytest.raises(BackendUnavailableError, match="was created is unknown"):
            writer.commit()
        monkeypatch.undo()
        manifest = writer.commit()
        assert manifest.save_id == writer.save_id
        assert_complete(store, "r", 2, writer.save_id)


def test_a_marker_put_that_outlived_the_retry_deadline_is_not_sent_again(s3_backend, proxy):
    # an outage the policy rode until its deadline: the commit reads back once and reports the
    # unknown outcome, instead of spending the whole deadline again on each further try
    policy = RetryPolicy(max_attempts=3, deadline_s=5, base_backoff_s=0.05, jitter=0.0)
    with CheckpointStore(s3_backend.url, through(s3_backend, proxy, False), retry=policy) as store:
        writer = store.run("r").begin(9, fence=start(store))
        writer.write_many(FILES)
        proxy.fail(method="PUT", path=MARKER, status=500, count=100)  # never forwarded
        with pytest.raises(BackendUnavailableError, match="was created is unknown"):
            writer.commit()
        puts = [r for r in proxy.log if r.method == "PUT" and r.path.endswith("/_COMMIT")]
        assert len(puts) == policy.max_attempts, proxy.log
        writer.abort()
        proxy.clear()
        assert payload_of(store, writer) == set(FILES)  # the marker may still name it
