"""Backend exceptions translated once, where a backend class calls fsspec or the OS.

Every public operation of a ``Backend`` runs inside ``translated``: a transport, permission,
disk or option failure becomes a ``BackendUnavailableError`` (or ``StorageOptionsRefusedError``)
that names what was being done, carries the location's masked URL and says how to fix it.
File-level not-found and exists errors pass through for the caller to interpret (a read of
a file that is not there is an answer, not an outage). The backend's text is redacted:
botocore, aiohttp and fsspec echo URLs, bucket names and request parameters, which may carry
the credentials of the URL or storage_options.
"""

from __future__ import annotations

import contextlib
import errno
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from zephon.storage.errors import BackendUnavailableError, StorageError, StorageOptionsRefusedError
from zephon.storage.redact import redact
from zephon.storage.retry import carry_retry_state, give_up, reply_status, retry_summary

if TYPE_CHECKING:
    from zephon.storage.backends.base import Backend

__all__ = [
    "full_disk_fix",
    "is_backend_failure",
    "missing_parent_fix",
    "native_error",
    "native_errors",
    "read_only_fix",
    "translated",
]

_PASSTHROUGH = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
_NETWORK_MODULES = (
    "botocore",
    "aiobotocore",
    "aiohttp",
    "google",
    "gcsfs",
    "azure",
    "requests",
    "urllib3",
)
#: replies that are answers, not failures, by the class names of libraries that do not raise
#: the builtin errors themselves (azure.core.exceptions: 404; 409 ``BlobAlreadyExists``; 412
#: ``ConditionNotMet``, which only a conditional write of ours can get, and which the
#: conditional writes here make only to create a file that must not exist)
_ANSWER_CLASSES: dict[str, type[OSError]] = {
    "ResourceNotFoundError": FileNotFoundError,
    "ResourceExistsError": FileExistsError,
    "ResourceModifiedError": FileExistsError,
}
#: libraries whose own code raising a TypeError or AttributeError means unusable options
_BACKEND_MODULES = (*_NETWORK_MODULES, "s3fs", "gcsfs", "adlfs", "fsspec.implementations")


def _raised_in_backend(exc: BaseException, modules: tuple[str, ...] = _BACKEND_MODULES) -> bool:
    """Whether the exception was raised inside a backend library (s3fs, gcsfs, fsspec's
    implementations, botocore, ...): a TypeError or AttributeError there means the backend was
    given options it cannot use (s3fs builds its session lazily, on the first request)."""
    tb = exc.__traceback__
    module = ""
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "") or ""
        tb = tb.tb_next
    return module.startswith(modules)


def is_backend_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the backend failing (transport, permission, disk, unusable options),
    as opposed to an answer (not found, exists) or an error the storage layer raised itself."""
    if isinstance(exc, (*_PASSTHROUGH, StorageError)):
        return False
    if isinstance(exc, OSError | ConnectionError | TimeoutError):
        return True
    module = type(exc).__module__ or ""
    if module.startswith(_NETWORK_MODULES):
        return True
    if isinstance(exc, NotImplementedError):  # a filesystem that cannot list, write, ...
        return _raised_in_backend(exc, ("fsspec", *_BACKEND_MODULES))
    return isinstance(exc, TypeError | AttributeError | KeyError) and _raised_in_backend(exc)


@contextlib.contextmanager
def translated(backend: Backend, action: str, *, creating: bool = False) -> Iterator[None]:
    """Run the block, translating a backend failure into a ``StorageError`` about
    ``backend.url``; ``action`` says what was being done ("listing s3://b/ckpt/r1").

    ``creating``: the block makes a file or directory, so "not found" (or "not a directory")
    can only mean the bucket or a parent directory is missing, which is the storage being
    unusable, not an answer for the caller to interpret (as it is for a read).
    """
    try:
        yield
    except Exception as exc:
        answer = file_answer(exc)
        if isinstance(answer, FileNotFoundError | NotADirectoryError) and creating:
            raise BackendUnavailableError(
                f"{action} failed: {type(exc).__name__}: {redact(exc, backend.secrets)}; "
                f"{missing_parent_fix(backend)}",
                url=backend.url,
            ) from exc
        if answer is exc:
            raise
        if answer is not None:
            raise answer from exc
        if not is_backend_failure(exc):
            raise
        raise _translation(backend, action, exc) from exc


def file_answer(exc: BaseException) -> OSError | None:
    """The file-level answer ``exc`` is: itself if it is a builtin one (not found, exists, a
    directory, not a directory); a builtin one made from a library's own class for it (Azure's
    ``ResourceNotFoundError`` becomes ``FileNotFoundError``, ...); else None."""
    if isinstance(exc, _PASSTHROUGH):
        return exc
    for klass in type(exc).__mro__:
        answer = _ANSWER_CLASSES.get(klass.__name__)
        if answer is not None:
            code = getattr(exc, "error_code", None) or klass.__name__
            return answer(f"{code} (HTTP {getattr(exc, 'status_code', '?')})")
    return None


def _translation(backend: Backend, action: str, exc: Exception) -> StorageError:
    tried = retry_summary(exc)
    what = f"{action} failed on {backend.url}{f' {tried}' if tried else ''}: "
    what += f"{type(exc).__name__}: {redact(exc, backend.secrets)}"
    if isinstance(exc, TypeError | AttributeError | KeyError):
        error: StorageError = StorageOptionsRefusedError(what, url=backend.url)
    else:
        error = BackendUnavailableError(f"{what}; {_fix(backend, exc, tried)}", url=backend.url)
    carry_retry_state(exc, error)  # a policy around this one knows it was given up on
    return error


def _fix(backend: Backend, exc: Exception, tried: str | None) -> str:
    if isinstance(exc, NotImplementedError):
        return (
            f"the {backend.protocol}:// filesystem cannot do this: keep checkpoints on local "
            "disk, S3, GCS or another filesystem that lists, reads and writes files"
        )
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return read_only_fix(backend)
    if isinstance(exc, PermissionError) and backend.posix_paths:
        return f"check that this user may read and write under {backend.url}"
    if isinstance(exc, PermissionError) or reply_status(exc) in (401, 403):
        return "check the credentials and permissions in storage_options"
    if isinstance(exc, OSError) and exc.errno in {errno.ENOSPC, errno.EDQUOT}:
        return full_disk_fix(backend)
    if tried:
        return "check that the endpoint is reachable, or give the store a longer retry deadline"
    return "check that the endpoint is reachable and storage_options are right"


def read_only_fix(backend: Backend) -> str:
    """What to do when the filesystem under the backend's root is mounted read-only."""
    instead = (
        f"set {backend.role} to a writable directory"
        if backend.role is not None
        else "use a writable location"
    )
    return f"{backend.url} is on a read-only filesystem: remount it read-write or {instead}"


def missing_parent_fix(backend: Backend) -> str:
    """What to do when a file cannot be created because what holds it does not exist: the
    bucket of an object store, a directory that cannot be made on local disk."""
    if backend.has_directories:
        return (
            f"the directory {backend.url} must exist or be creatable: create it first or fix "
            "the path"
        )
    bucket = backend.display(backend.root.split("/", 1)[0])
    word = backend.bucket_word
    return f"the {word} {bucket} must exist: create it first or fix the URL"


def full_disk_fix(backend: Backend) -> str:
    """What to do when the disk (or quota) under the backend's root is full: named by the
    setting the location came from (``role``), since only its owner knows which to change."""
    if backend.role is not None:
        return (
            f"the disk holding {backend.role} {backend.url} is full: free space there or "
            f"set {backend.role} to a directory on a larger disk"
        )
    return (
        f"the disk holding {backend.url} is full: free space there or use a location on a "
        "larger disk"
    )


# -- obstore (the native data path, ``storage.backends.native``) ---------------------------------

_STATUS = re.compile(r"status(?: code)?:? (\d{3})")
_S3_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")


class NativeReplyError(OSError):
    """An error reply to a request of the native client, in the shape the retry policy reads
    (``response`` as botocore gives it: the error code and the HTTP status), so 5xx and
    throttling are tried again and 401/403 are named as credentials, as on the fsspec path."""

    def __init__(self, message: str, code: str, status: int) -> None:
        super().__init__(message)
        self.response = {
            "Error": {"Code": code},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": {}},
        }


class NativeConnectionError(ConnectionError):
    """The native client's request got no reply (refused, reset, timed out): transient."""


def native_error(exc: BaseException) -> BaseException:
    """The exception the fsspec path would raise for obstore's ``exc``: ``FileNotFoundError``,
    ``FileExistsError``, ``PermissionError``, a reply error carrying its status, or a
    connection error; ``exc`` itself if it is none of obstore's."""
    names = {klass.__name__ for klass in type(exc).__mro__}
    text = str(exc)
    first = text.split("\n", 1)[0]  # obstore appends a multi-line debug dump
    if "NotFoundError" in names or isinstance(exc, FileNotFoundError):
        return FileNotFoundError(first)
    if names & {"AlreadyExistsError", "PreconditionError"} or isinstance(exc, FileExistsError):
        return FileExistsError(first)
    if names & {"PermissionDeniedError", "UnauthenticatedError"} or isinstance(
        exc, PermissionError
    ):
        return PermissionError(first)
    if not type(exc).__module__.startswith("obstore"):
        return exc
    status = _STATUS.search(text)
    if status is not None:
        code = _S3_CODE.search(text)
        return NativeReplyError(first, code.group(1) if code else "", int(status.group(1)))
    lowered = text.lower()
    if any(word in lowered for word in ("connect", "timed out", "timeout", "reset", "broken")):
        return NativeConnectionError(first)
    if names & {"UnknownConfigurationKeyError"}:
        return TypeError(first)
    return NativeReplyError(first, "", 0) if "GenericError" in names else exc


@contextlib.contextmanager
def native_errors(*, given_up: bool = False) -> Iterator[None]:
    """Raise obstore's errors as ``native_error`` makes them (``translated`` then treats them
    as every backend's). ``given_up``: the client already tried the request under the retry
    policy (multipart uploads), so no policy around it tries it again."""
    try:
        yield
    except Exception as exc:
        answer = native_error(exc)
        if given_up and answer is not exc:
            give_up(answer)
        if answer is exc:
            raise
        raise answer from exc
