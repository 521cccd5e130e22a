"""The retry policy at the backend boundary (storage/retry.py): transient failures of every
primitive are tried again with backoff under a deadline, per part for multipart uploads,
honouring the server's Retry-After; a 403, a 404 and a lost create-only PUT are not tried
again. On moto's S3 behind ``tests.faults.FaultProxy``, with short deadlines."""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid

import pytest

from tests.conftest import random_payload
from tests.faults import FaultProxy
from zephon.storage import (
    BackendUnavailableError,
    CheckpointStore,
    CommitConflictError,
    RetryPolicy,
)
from zephon.storage.backends import Backend
from zephon.storage.retry import is_throttling, is_transient, retry_after_s

PART = 5 << 20
#: fast enough for tests: small backoffs, a deadline of seconds
QUICK = RetryPolicy(
    max_attempts=50, deadline_s=20, base_backoff_s=0.01, max_backoff_s=0.2, throttle_backoff_s=0.05
)


@pytest.fixture
def faulty(s3):
    """``(open_store, proxy)``: stores on a fresh bucket of moto reached through a FaultProxy."""
    bucket = f"zt-retry-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(bucket)
    with FaultProxy(s3.endpoint_url, seed=7) as proxy:
        options = {**s3.storage_options(), "client_kwargs": {"endpoint_url": proxy.url}}
        stores: list[CheckpointStore] = []

        def open_store(retry: RetryPolicy = QUICK) -> CheckpointStore:
            store = CheckpointStore(f"s3://{bucket}/ckpt", options, retry=retry, part_size=PART)
            stores.append(store)
            return store

        yield open_store, proxy
        for store in stores:
            store.close()


def requests(proxy: FaultProxy, method: str, pattern: str) -> list[str]:
    """The outcomes of the logged ``method`` requests whose path matches ``pattern``."""
    return [r.outcome for r in proxy.log if r.method == method and re.search(pattern, r.path)]


def save(store: CheckpointStore, step: int, files: dict[str, bytes], streamed: bytes) -> None:
    with store.run("r").begin(step) as writer:
        writer.write_many(files)
        with writer.open("streamed.bin") as out:
            out.write(streamed)
        writer.commit()


def load_and_check(store: CheckpointStore, step: int, expected: dict[str, bytes]) -> None:
    reader = store.run("r").reader(step)
    for name, data in expected.items():
        assert reader.read_bytes(name) == data
    with reader.open("streamed.bin") as handle:
        assert handle.read() == expected["streamed.bin"]
    assert store.run("r").verify(step, deep=True).ok


def later(seconds: float, action) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


# -- faults on the wire (S3 through FaultProxy) --------------------------------------------------


def test_a_save_and_a_load_succeed_through_twenty_percent_faults_and_the_bytes_verify(faulty):
    open_store, proxy = faulty
    store = open_store()
    files = {f"small-{i}.bin": random_payload(1000 + i) for i in range(6)}
    files["big.bin"] = random_payload(2 * PART + 1234)  # a multipart put of three parts
    streamed = random_payload(2 * PART + 99)  # a streamed multipart upload of three parts
    proxy.set_rates(error=0.05, slow_down=0.05, reset=0.05, truncate=0.05, retry_after_s=0)
    save(store, 1, files, streamed)
    load_and_check(store, 1, {**files, "streamed.bin": streamed})
    faults = [r for r in proxy.log if r.outcome != "ok"]
    assert len(faults) >= 5, proxy.log  # the faults really were there
    assert {r.outcome for r in faults} >= {"error", "slow_down", "reset"}


def test_an_outage_of_four_seconds_is_ridden_out_by_a_save_and_by_a_load(faulty):
    open_store, proxy = faulty
    store = open_store()
    files = {"a.bin": random_payload(3000)}
    streamed = random_payload(PART + 10)
    proxy.outage(True)
    started = time.monotonic()
    later(4, lambda: proxy.outage(False))
    save(store, 1, files, streamed)
    assert time.monotonic() - started >= 4
    proxy.outage(True)
    started = time.monotonic()
    later(4, lambda: proxy.outage(False))
    load_and_check(store, 1, {**files, "streamed.bin": streamed})
    assert time.monotonic() - started >= 4
    assert len(proxy.outcomes("outage")) >= 4


def test_an_outage_longer_than_the_deadline_fails_in_time_with_one_error_naming_the_url(faulty):
    open_store, proxy = faulty
    store = open_store(RetryPolicy(deadline_s=3, base_backoff_s=0.05, max_backoff_s=0.5))
    proxy.outage(True)
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError) as caught:
        store.run("r").marker_bytes(1)
    elapsed = time.monotonic() - started
    assert 2.4 <= elapsed <= 3 + 2, elapsed
    message = str(caught.value)
    assert "\n" not in message
    assert store.run("r").checkpoint_url(1) in message
    assert re.search(r"after \d+ attempts in [23]\.\d s", message), message
    assert "retry deadline" in message
    assert len(proxy.outcomes("outage")) >= 4


@pytest.mark.parametrize("status", [403, 404, 400])
def test_a_refusal_or_a_missing_object_is_asked_once(faulty, status):
    open_store, proxy = faulty
    store = open_store()
    proxy.fail(method="GET", path=r"/_COMMIT", status=status, count=5)
    if status == 404:
        assert store.run("r").marker_bytes(1) is None
    else:
        with pytest.raises(BackendUnavailableError):
            store.run("r").marker_bytes(1)
    assert requests(proxy, "GET", r"/_COMMIT") == ["fail"]


def test_throttling_waits_as_long_as_the_servers_retry_after(faulty):
    open_store, proxy = faulty
    store = open_store()  # its own backoffs are all below 0.2 s
    proxy.set_rates(slow_down=1.0, retry_after_s=2)
    started = time.monotonic()
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(store.run("r").marker_bytes(1)))
    thread.start()
    while not proxy.outcomes("slow_down"):
        time.sleep(0.01)
    proxy.set_rates()  # the next try goes through
    thread.join(timeout=10)
    assert result == [None]
    assert time.monotonic() - started >= 2
    assert requests(proxy, "GET", r"/_COMMIT") == ["slow_down", "ok"]


def test_a_reply_held_past_the_read_timeout_is_asked_again(s3):
    bucket = f"zt-retry-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(bucket)
    with FaultProxy(s3.endpoint_url) as proxy:
        options = {
            **s3.storage_options(),
            "client_kwargs": {"endpoint_url": proxy.url},
            "config_kwargs": {"read_timeout": 1},
        }
        with CheckpointStore(f"s3://{bucket}/ckpt", options, retry=QUICK) as store:
            proxy.set_rates(stall=1.0, stall_s=3)
            result: list[object] = []
            thread = threading.Thread(target=lambda: result.append(store.run("r").marker_bytes(1)))
            thread.start()
            while not proxy.outcomes("stall"):
                time.sleep(0.01)
            proxy.set_rates()
            thread.join(timeout=10)
    assert result == [None]
    assert requests(proxy, "GET", r"/_COMMIT") == ["stall", "ok"]


def test_a_failed_part_is_sent_again_alone_never_the_whole_file(faulty):
    open_store, proxy = faulty
    store = open_store()
    data = random_payload(2 * PART + 7)
    proxy.fail(method="PUT", path=r"[?&]partNumber=2(&|$)", status=500, count=4)
    with store.run("r").begin(1) as writer:
        writer.write_bytes("put.bin", data)  # put_bytes: parts sent together
        with writer.open("streamed.bin") as out:  # a stream: parts sent as the buffer fills
            out.write(data)
        writer.commit()
    part = r"[?&]partNumber={}(&|$)"
    assert requests(proxy, "PUT", part.format(1)) == ["ok", "ok"]  # once per file
    assert requests(proxy, "PUT", part.format(2)).count("fail") == 4
    assert requests(proxy, "PUT", part.format(2)).count("ok") == 2
    assert proxy.pending_rules == 0
    load_and_check_pair(store, data)


def load_and_check_pair(store: CheckpointStore, data: bytes) -> None:
    reader = store.run("r").reader(1)
    assert reader.read_bytes("put.bin") == data and reader.read_bytes("streamed.bin") == data


def test_a_multipart_upload_whose_completion_reply_was_lost_is_complete(faulty):
    """The server completed the upload; the retry finds it gone (NoSuchUpload) and the object
    there: the write succeeded."""
    open_store, proxy = faulty
    store = open_store()
    data = random_payload(2 * PART + 5)
    proxy.drop_reply(method="POST", path=r"[?&]uploadId=", count=2)
    with store.run("r").begin(1) as writer:
        writer.write_bytes("put.bin", data)
        with writer.open("streamed.bin") as out:
            out.write(data)
        writer.commit()
    assert len(proxy.outcomes("drop_reply")) == 2
    load_and_check_pair(store, data)


def test_a_create_only_put_whose_reply_was_lost_is_not_tried_in_a_loop(faulty):
    """Tried again once, the marker PUT is answered 412: ``FileExistsError``, never tried
    again (telling its own marker from another's is the commit's business)."""
    open_store, proxy = faulty
    store = open_store()
    proxy.drop_reply(method="PUT", path=r"/_COMMIT$", count=1)
    with contextlib.suppress(CommitConflictError), store.run("r").begin(1) as writer:
        writer.write_bytes("a.bin", b"a")
        writer.commit()
    assert requests(proxy, "PUT", r"/_COMMIT$") == ["drop_reply", "ok"]
    assert store.run("r").is_committed(1)


def test_listings_deletes_and_existence_checks_are_tried_again(faulty):
    open_store, proxy = faulty
    store = open_store()
    with store.run("r").begin(1) as writer:
        writer.write_many({"a": b"1", "b": b"2"})
        writer.commit()
    proxy.fail(method="GET", path=r"list-type=2", status=500, count=2)
    assert store.run("r").committed_steps() == [1]
    proxy.fail(method="HEAD", status=503, count=1)
    proxy.fail(method="GET", path=r"list-type=2", status=503, count=1)
    assert store.run("r").is_committed(1)
    assert store.runs() == ["r"]
    proxy.fail(method="POST", path=r"[?&]delete", status=500, count=2)
    assert store.run("r").delete(1) == 2
    assert store.run("r").committed_steps() == []
    assert proxy.pending_rules == 0 or proxy.pending_rules == 1  # a HEAD may not be sent


# -- the policy itself -------------------------------------------------------------------------


def client_error(code: str, status: int, headers: dict | None = None):
    from botocore.exceptions import ClientError

    meta = {"HTTPStatusCode": status, "HTTPHeaders": headers or {}}
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": meta}, "GetObject")


def as_s3fs(error: Exception) -> BaseException:
    """The exception s3fs raises for a botocore error (the ClientError is its cause)."""
    from s3fs.errors import translate_boto_error

    return translate_boto_error(error)


@pytest.mark.parametrize(
    ("code", "status", "transient"),
    [
        ("InternalError", 500, True),
        ("BadGateway", 502, True),
        ("ServiceUnavailable", 503, True),
        ("GatewayTimeout", 504, True),
        ("SlowDown", 503, True),
        ("ThrottlingException", 400, True),
        ("RequestTimeout", 400, True),
        ("NotImplemented", 501, False),
        ("AccessDenied", 403, False),
        ("NoSuchKey", 404, False),
        ("InvalidArgument", 400, False),
        ("PreconditionFailed", 412, False),
    ],
)
def test_the_classifier_on_s3_replies(code, status, transient):
    error = client_error(code, status)
    assert is_transient(error) is transient
    assert is_transient(as_s3fs(error)) is transient


def test_the_classifier_on_transport_failures_and_local_errors():
    import aiohttp
    from botocore.exceptions import (
        ConnectionClosedError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
    )

    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(ConnectionClosedError(endpoint_url="http://x"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert is_transient(IncompleteReadError(actual_bytes=1, expected_bytes=2))
    assert is_transient(aiohttp.ClientPayloadError("Response payload is not completed"))
    assert is_transient(aiohttp.ServerDisconnectedError())
    for never in (
        FileNotFoundError("x"),
        FileExistsError("x"),
        PermissionError("x"),
        OSError(28, "No space left on device"),
        ValueError("x"),
    ):
        assert not is_transient(never), never


def test_the_classifier_on_gcs_replies():
    from gcsfs.retry import HttpError

    assert is_transient(HttpError({"code": 429, "message": "rate"}))
    assert is_throttling(HttpError({"code": 429, "message": "rate"}))
    assert is_transient(HttpError({"code": 503, "message": "x"}))
    assert not is_transient(HttpError({"code": 403, "message": "x"}))


def test_throttling_is_recognised_with_its_retry_after():
    error = as_s3fs(client_error("SlowDown", 503, {"retry-after": "3"}))
    assert is_throttling(error) and retry_after_s(error) == 3
    assert not is_throttling(client_error("InternalError", 500))
    assert retry_after_s(client_error("SlowDown", 503)) is None
    policy = RetryPolicy(base_backoff_s=0.01, max_backoff_s=0.1, throttle_backoff_s=0.5)
    assert policy.backoff_s(1, error) == 3
    assert policy.backoff_s(1, client_error("SlowDown", 503)) == 0.5


def test_the_backoff_doubles_up_to_its_cap_less_at_most_the_jitter():
    exact = RetryPolicy(base_backoff_s=0.1, max_backoff_s=1.0, jitter=0)
    assert [exact.backoff_s(n) for n in range(1, 7)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    )
    jittered = RetryPolicy(base_backoff_s=0.1, max_backoff_s=1.0, jitter=0.5)
    delays = [jittered.backoff_s(3) for _ in range(200)]
    assert all(0.2 <= d <= 0.4 for d in delays) and len(set(delays)) > 100


def test_the_defaults_ride_out_a_minute_of_outage():
    policy = RetryPolicy()
    assert policy.deadline_s >= 120
    # even with the most jitter, the attempts last longer than a minute of waiting
    longest = [
        min(policy.max_backoff_s, policy.base_backoff_s * 2 ** (n - 1))
        for n in range(1, policy.max_attempts)
    ]
    shortest = sum(longest) * (1 - policy.jitter)
    assert shortest > 60


def test_a_call_gives_up_at_its_attempts_or_before_its_deadline():
    calls: list[float] = []

    def broken() -> None:
        calls.append(time.monotonic())
        raise ConnectionResetError("reset")

    with pytest.raises(ConnectionResetError):
        RetryPolicy(max_attempts=4, base_backoff_s=0.001, max_backoff_s=0.001).call(broken)
    assert len(calls) == 4
    calls.clear()
    started = time.monotonic()
    with pytest.raises(ConnectionResetError) as caught:
        RetryPolicy(deadline_s=0.3, base_backoff_s=0.05, max_backoff_s=0.05, jitter=0).call(broken)
    assert time.monotonic() - started <= 0.3 + 0.05
    assert 4 <= len(calls) <= 8
    assert re.fullmatch(r"after \d+ attempts in 0\.\d s", caught.value._zephon_retry_summary)


def test_what_is_not_transient_is_raised_at_once_and_success_ends_the_tries():
    outcomes = iter([ConnectionResetError(), ConnectionResetError(), "done"])
    tries = []

    def flaky() -> str:
        tries.append(1)
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert RetryPolicy(base_backoff_s=0.001, max_backoff_s=0.001).call(flaky) == "done"
    assert len(tries) == 3
    tries.clear()

    def missing() -> None:
        tries.append(1)
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        RetryPolicy().call(missing)
    assert len(tries) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": 1.5},
        {"deadline_s": -1},
        {"jitter": 2},
        {"base_backoff_s": 5, "max_backoff_s": 1},
    ],
)
def test_a_policy_out_of_range_is_refused(kwargs):
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)


def test_a_backend_class_cannot_bypass_the_policy():
    with pytest.raises(TypeError, match="implement _read_small instead"):

        class Bypassing(Backend):  # noqa: F841 - refused at definition
            def read_small(self, path: str) -> bytes:
                return b""


def test_every_store_opens_with_the_default_policy_unless_given_one(tmp_path):
    assert CheckpointStore(str(tmp_path)).location.retry == RetryPolicy()
    policy = RetryPolicy(max_attempts=3)
    assert CheckpointStore(str(tmp_path), retry=policy).location.backend.retry is policy


def test_botocore_and_s3fs_do_not_retry_under_zephons_policy(faulty):
    open_store, _proxy = faulty
    fs = open_store().location.fs
    fs.connect()
    assert fs.retries == 1
    assert fs.s3.meta.config.retries["total_max_attempts"] == 1
