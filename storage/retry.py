"""The one retry policy of the storage layer: transient backend failures are tried again with
exponential backoff and jitter under a total deadline, at the backend boundary
(``storage.backends``), for reads and writes alike.

botocore and s3fs retry a few times within a second, so an outage of a minute used to fail
every pending upload at once. Here each backend primitive (one read, one ranged read, one put,
one listing, one batched delete, one part of a multipart upload) is an idempotent unit tried
again until it succeeds, fails for good, runs out of attempts or passes its deadline.

Transient (tried again): HTTP 5xx but 501, throttling (S3 ``SlowDown``, ``Throttling*``, HTTP
429, honouring the server's ``Retry-After``), request timeouts (``RequestTimeout``, HTTP 408),
connection refusals, resets and timeouts, truncated or unparsable replies and checksum
mismatches in transit. Never: anything else of 4xx, ``FileNotFoundError``, ``FileExistsError``
(a create-only PUT that lost the race, or whose first reply was lost), permission errors and
local disk errors. The same rules read the replies of every library: botocore's error codes,
gcsfs's ``HttpError``, azure.core's ``HttpResponseError`` (``error_code``, ``status_code``) and
its ``ServiceRequestError`` / ``ServiceResponseError`` (no connection, a reply cut short).
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from zephon.storage.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_RETRY",
    "carry_retry_state",
    "give_up",
    "NO_RETRY",
    "RetryPolicy",
    "is_throttling",
    "is_transient",
    "reply_status",
    "retry_after_s",
    "retry_summary",
]

T = TypeVar("T")

#: S3 and other AWS error codes that mean "later", whatever their status
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "XAmzContentSHA256Mismatch",  # the body was damaged in transit
        "BadDigest",
        "IncompleteBody",  # the connection broke while the body was being sent
        "OperationTimedOut",  # Azure: the server ran out of time
    }
)
_THROTTLING_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
        "ServerBusy",  # Azure (503): the account's or partition's limits
    }
)
#: transport failures by class name (anywhere in the class's MRO), so that no optional
#: library needs importing: botocore, aiohttp, requests, urllib3, http.client, fsspec, gcsfs
_TRANSIENT_CLASSES = frozenset(
    {
        # botocore / aiobotocore
        "HTTPClientError",  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "IncompleteReadError",
        "ResponseParserError",
        "FlexibleChecksumError",
        # aiohttp
        "ClientConnectionError",  # ServerDisconnectedError, ClientOSError, ...
        "ClientPayloadError",
        "ServerTimeoutError",
        # requests / urllib3 / http.client
        "ChunkedEncodingError",
        "ContentDecodingError",
        "ProxyError",
        "ProtocolError",
        "IncompleteRead",
        "RemoteDisconnected",
        # azure.core: no connection, or the reply broke off (their *TimeoutError subclasses)
        "ServiceRequestError",
        "ServiceResponseError",
        # fsspec, gcsfs
        "FSTimeoutError",
        "ChecksumError",
    }
)
#: OS errors of a connection, not of a disk
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ENETRESET,
    }
)
_NEVER = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)
_SUMMARY = "_zephon_retry_summary"
#: set on a failure a policy gave up on: another policy around it does not try it again (a
#: multipart upload's parts are tried inside the put that sends them)
_GIVEN_UP = "_zephon_retry_given_up"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and those it was raised from (s3fs keeps botocore's ``ClientError`` as
    the ``__cause__`` of the ``OSError`` it translates it into)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _response_of(exc: BaseException) -> tuple[str, int | None, dict[str, Any]] | None:
    """``(error code, HTTP status, headers)`` of an HTTP error reply, if ``exc`` is one
    (botocore's ``ClientError``, gcsfs's ``HttpError``, azure.core's ``HttpResponseError``)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        meta = response.get("ResponseMetadata") or {}
        status = meta.get("HTTPStatusCode")
        code = str((response.get("Error") or {}).get("Code") or "")
        return code, status if isinstance(status, int) else None, meta.get("HTTPHeaders") or {}
    if any(klass.__name__ == "HttpResponseError" for klass in type(exc).__mro__):
        status = getattr(exc, "status_code", None)
        headers = getattr(getattr(exc, "response", None), "headers", None) or {}
        return (
            str(getattr(exc, "error_code", None) or ""),
            status if isinstance(status, int) else None,
            dict(headers),
        )
    if type(exc).__name__ == "HttpError":
        code = getattr(exc, "code", None)
        try:
            return "", int(code), {}
        except (TypeError, ValueError):
            return None
    return None


def _reply_verdict(code: str, status: int | None) -> bool:
    if code in _THROTTLING_CODES or code in _TRANSIENT_CODES or "Throttl" in code:
        return True
    if status is None:
        return False
    return status in (408, 429) or (status >= 500 and status != 501)


def _is_transport_failure(exc: BaseException) -> bool:
    names = {klass.__name__ for klass in type(exc).__mro__}
    if names & _TRANSIENT_CLASSES:
        return True
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth trying again: a 5xx, throttling, a timeout, a broken
    connection or a damaged reply. Never a not-found, an exists (a precondition failure), a
    permission error or any other 4xx."""
    if isinstance(exc, _NEVER) or getattr(exc, _GIVEN_UP, False):
        return False
    for link in _chain(exc):
        if isinstance(link, _NEVER):
            return False
        reply = _response_of(link)
        if reply is not None:
            return _reply_verdict(reply[0], reply[1])
        if _is_transport_failure(link):
            return True
    return False


def is_throttling(exc: BaseException) -> bool:
    """Whether the server asked the client to slow down (S3 ``SlowDown``, ``Throttling*``,
    HTTP 429)."""
    for link in _chain(exc):
        reply = _response_of(link)
        if reply is not None:
            code, status, _ = reply
            return code in _THROTTLING_CODES or "Throttl" in code or status == 429
    return False


def reply_status(exc: BaseException) -> int | None:
    """The HTTP status of the error reply ``exc`` carries (or was raised from), if any."""
    for link in _chain(exc):
        reply = _response_of(link)
        if reply is not None:
            return reply[1]
    return None


def retry_after_s(exc: BaseException) -> float | None:
    """The delay the server asked for in ``Retry-After`` (seconds), if any."""
    for link in _chain(exc):
        reply = _response_of(link)
        if reply is None:
            continue
        headers = {str(k).lower(): v for k, v in reply[2].items()}
        try:
            value = float(headers["retry-after"])
        except (KeyError, TypeError, ValueError):
            return None  # absent, or an HTTP date: the policy's own backoff applies
        return max(0.0, value)
    return None


def retry_summary(exc: BaseException) -> str | None:
    """How long a failure was tried before it was given up on ("after 7 attempts in 12.0
    s"), if a policy tried it more than once; messages append it."""
    return getattr(exc, _SUMMARY, None)


def carry_retry_state(source: BaseException, target: BaseException) -> None:
    """Give ``target`` (the translation of ``source``) what a policy recorded on ``source``:
    its ``retry_summary``, and that it was given up on (no policy around tries it again)."""
    for name in (_SUMMARY, _GIVEN_UP):
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))


def _give_up(exc: BaseException, failures: int, elapsed: float) -> None:
    try:
        setattr(exc, _GIVEN_UP, True)
        if failures > 1:
            setattr(exc, _SUMMARY, f"after {failures} attempts in {elapsed:.1f} s")
    except AttributeError:  # an exception class with __slots__: tried again by an outer one
        pass


def give_up(exc: BaseException) -> None:
    """Mark ``exc`` as given up on by a client that already tried it under the policy (the
    native client's multipart uploads): no policy around it tries it again."""
    _give_up(exc, 1, 0.0)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How transient backend failures are tried again: up to ``max_attempts`` tries of one
    request within ``deadline_s`` seconds of its first try, waiting ``base_backoff_s * 2**n``
    (at most ``max_backoff_s``) between tries, less a random share of up to ``jitter`` of it
    (so that many uploads failing together do not come back together). Throttling waits at
    least ``throttle_backoff_s``, or the server's ``Retry-After`` if it asks for longer.

    The defaults ride out an outage of a minute or more: about two minutes of tries.
    ``RetryPolicy(max_attempts=1)`` tries everything once.
    """

    max_attempts: int = 30
    deadline_s: float = 120.0
    base_backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    jitter: float = 0.5
    throttle_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if (
            not isinstance(self.max_attempts, int)
            or isinstance(self.max_attempts, bool)
            or self.max_attempts < 1
        ):
            raise InvalidArgumentError(
                f"RetryPolicy max_attempts={self.max_attempts!r} must be an integer of at least 1 "
                "(1: no retries)"
            )
        for name in ("deadline_s", "base_backoff_s", "max_backoff_s", "throttle_backoff_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(
                    f"RetryPolicy {name}={value!r} must be a number of seconds >= 0"
                )
        if self.max_backoff_s < self.base_backoff_s:
            raise InvalidArgumentError(
                f"RetryPolicy max_backoff_s={self.max_backoff_s} is below base_backoff_s="
                f"{self.base_backoff_s}; raise max_backoff_s"
            )
        jitter = self.jitter
        if not isinstance(jitter, int | float) or isinstance(jitter, bool) or not 0 <= jitter <= 1:
            raise InvalidArgumentError(
                f"RetryPolicy jitter={jitter!r} must be a fraction from 0 to 1 of each backoff"
            )

    def backoff_s(self, failures: int, exc: BaseException | None = None) -> float:
        """The wait after the ``failures``-th failed try (1, 2, ...) of ``exc``: exponential,
        capped, less up to ``jitter`` of it at random; for throttling at least
        ``throttle_backoff_s`` and the server's ``Retry-After``."""
        delay = min(self.max_backoff_s, self.base_backoff_s * 2 ** (failures - 1))
        delay *= 1 - self.jitter * random.random()
        if exc is not None and is_throttling(exc):
            delay = max(delay, self.throttle_backoff_s, retry_after_s(exc) or 0.0)
        return delay

    def call(self, operation: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``operation(*args, **kwargs)``, tried again on transient failures. The last failure
        is raised as it is (with ``retry_summary``) once attempts or the deadline run out:
        a wait that would end past the deadline is not begun."""
        start = time.monotonic()
        failures = 0
        while True:
            try:
                return operation(*args, **kwargs)
            except Exception as exc:
                failures += 1
                if not is_transient(exc):
                    raise
                delay = self.backoff_s(failures, exc)
                elapsed = time.monotonic() - start
                if failures >= self.max_attempts or elapsed + delay > self.deadline_s:
                    _give_up(exc, failures, elapsed)
                    raise
                time.sleep(delay)


#: what every location gets unless told otherwise
DEFAULT_RETRY = RetryPolicy()
#: one try of everything
NO_RETRY = RetryPolicy(max_attempts=1)
