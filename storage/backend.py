"""The boundary between the storage layer and fsspec: backend errors translated once, and the
few primitive operations whose behaviour differs per backend, each a call of the location's
``Backend`` (``storage.backends``: one class per family of filesystems, chosen once when the
location was opened). Everything in the storage layer (and zephon, through ``storage``) calls
these functions; what differs between backends lives only in the backend classes.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from storage.backends.base import ListedFile, mtime_of
from storage.errors import BackendUnavailableError, StorageError, StorageOptionsRefusedError
from storage.redact import redact
from storage.retry import retry_summary

if TYPE_CHECKING:
    from storage.location import Location

__all__ = [
    "CreateOutcome",
    "ListedFile",
    "backend_errors",
    "create_exclusive",
    "create_settled",
    "file_exists",
    "get_file",
    "list_dirs",
    "list_files",
    "make_dirs",
    "mtime_of",
    "multipart_options",
    "open_read",
    "put_bytes",
    "outcome_unknown",
    "put_small",
    "read_file",
    "read_range",
    "read_ranges",
    "read_small",
    "remove_dir",
    "remove_empty_dirs",
    "remove_files",
    "sync_dirs",
]

_PASSTHROUGH = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "google", "gcsfs", "requests", "urllib3")
#: libraries whose own code raising a TypeError or AttributeError means unusable options
_BACKEND_MODULES = (*_NETWORK_MODULES, "s3fs", "gcsfs", "adlfs", "fsspec.implementations")


def _raised_in_backend(exc: BaseException) -> bool:
    """Whether the exception was raised inside a backend library (s3fs, gcsfs, fsspec's
    implementations, botocore, ...): a TypeError or AttributeError there means the backend was
    given options it cannot use (s3fs builds its session lazily, on the first request)."""
    tb = exc.__traceback__
    module = ""
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "") or ""
        tb = tb.tb_next
    return module.startswith(_BACKEND_MODULES)


def _is_backend_failure(exc: BaseException) -> bool:
    if isinstance(exc, (*_PASSTHROUGH, StorageError)):
        return False
    if isinstance(exc, OSError | ConnectionError | TimeoutError):
        return True
    module = type(exc).__module__ or ""
    if module.startswith(_NETWORK_MODULES):
        return True
    return isinstance(exc, TypeError | AttributeError | KeyError) and _raised_in_backend(exc)


@contextlib.contextmanager
def backend_errors(location: Location, action: str) -> Iterator[None]:
    """Turn a backend's transport, permission and disk errors into ``BackendUnavailableError``.

    ``action`` says what was being done ("listing run r1", "writing save-5/x.bin"); file-level
    not-found and exists errors pass through for the caller to interpret. The backend's text is
    redacted: botocore, aiohttp and fsspec echo URLs, bucket names and request parameters,
    which may carry the credentials of the URL or storage_options.
    """
    try:
        yield
    except Exception as exc:
        if not _is_backend_failure(exc):
            raise
        tried = retry_summary(exc)
        what = f"{action} failed on {location.url}{f' {tried}' if tried else ''}: "
        what += f"{type(exc).__name__}: {redact(exc, location.secrets)}"
        if isinstance(exc, TypeError | AttributeError | KeyError):
            raise StorageOptionsRefusedError(what, url=location.url) from exc
        if isinstance(exc, OSError) and exc.errno == errno.EROFS:
            fix = read_only_fix(location)
        elif isinstance(exc, PermissionError) and location.backend.posix_paths:
            fix = f"check that this user may read and write under {location.url}"
        elif isinstance(exc, PermissionError):
            fix = "check the credentials and permissions in storage_options"
        elif isinstance(exc, OSError) and exc.errno in {errno.ENOSPC, errno.EDQUOT}:
            fix = full_disk_fix(location)
        elif tried:
            fix = "check that the endpoint is reachable, or give the store a longer retry deadline"
        else:
            fix = "check that the endpoint is reachable and storage_options are right"
        raise BackendUnavailableError(f"{what}; {fix}", url=location.url) from exc


def read_only_fix(location: Location) -> str:
    """What to do when the filesystem under ``location`` is mounted read-only."""
    instead = (
        f"set {location.role} to a writable directory"
        if location.role is not None
        else "use a writable location"
    )
    return f"{location.url} is on a read-only filesystem: remount it read-write or {instead}"


def missing_parent_fix(location: Location) -> str:
    """What to do when a file cannot be created because what holds it does not exist: the
    bucket of an object store, a directory that cannot be made on local disk."""
    if location.backend.has_directories:
        return (
            f"the directory {location.url} must exist or be creatable: create it first or fix "
            "the path"
        )
    bucket = location.display(location.root.split("/", 1)[0])
    return f"the bucket {bucket} must exist: create it first or fix the URL"


def _created(location: Location, path: str, create: Callable[[], None]) -> None:
    """Run ``create`` (a make-directories or a create-only write): "not found" (or "not a
    directory") can only mean the bucket or a parent directory is missing, which is the
    storage being unusable, not an answer for the caller to interpret (as it is for a read)."""
    try:
        create()
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise BackendUnavailableError(
            f"creating {location.display(path)} failed: {type(exc).__name__}: "
            f"{redact(exc, location.secrets)}; {missing_parent_fix(location)}",
            url=location.url,
        ) from exc


def full_disk_fix(location: Location) -> str:
    """What to do when the disk (or quota) under ``location`` is full: named by the setting
    the location came from (``Location.role``), since only its owner knows which to change."""
    if location.role is not None:
        return (
            f"the disk holding {location.role} {location.url} is full: free space there or "
            f"set {location.role} to a directory on a larger disk"
        )
    return (
        f"the disk holding {location.url} is full: free space there or use a location on a "
        "larger disk"
    )


# -- the primitives: each asks the location's backend (storage.backends), chosen when the
# location was opened, which tries transient failures again under its policy
# (``location.retry``). One call style everywhere: ``operation(location, path, ...)``.


def list_files(location: Location, path: str, *, prefix: str = "") -> list[ListedFile]:
    """Every file below ``path`` with one listing where the backend allows it (object stores
    list a prefix recursively in pages); an absent path lists as empty. ``prefix`` keeps only
    the files whose first path component below ``path`` starts with it (filtered by the server
    where it can)."""
    return location.backend.list_files(path, prefix=prefix)


def list_dirs(location: Location, path: str) -> list[str]:
    """The names of the directories directly below ``path``; absent lists as empty."""
    return location.backend.list_dirs(path)


def remove_files(location: Location, paths: Iterable[str]) -> int:
    """Delete files in as few requests as the backend allows (S3 DeleteObjects: 1000 keys each,
    GCS batch: 100); missing ones are ignored. Returns how many paths were passed."""
    return location.backend.remove_files(paths)


def remove_empty_dirs(location: Location, top: str) -> None:
    """Remove now-empty directories under and including ``top`` (where the backend has
    directories: object stores have none to remove)."""
    location.backend.remove_empty_dirs(top)


def remove_dir(location: Location, path: str) -> None:
    """Remove ``path`` if it is an empty directory (where the backend has directories)."""
    location.backend.remove_dir(path)


def make_dirs(location: Location, path: str, *, durable: bool = False) -> None:
    """Make directory ``path`` and its parents where the backend needs them before a file is
    written into it (local disk); ``durable``: the new entries survive a power loss.
    ``BackendUnavailableError`` if the directory cannot exist there."""
    _created(location, path, lambda: location.backend.make_dirs(path, durable=durable))


def sync_dirs(location: Location, paths: Iterable[str]) -> None:
    """Make the entries of these directories durable (local disk: fsync); a no-op elsewhere."""
    location.backend.sync_dirs(paths)


def multipart_options(location: Location, part_size: int) -> dict:
    """Keyword arguments that make ``pipe_file`` split data of at least two parts into a
    multipart (S3) or resumable (GCS) upload of ``part_size`` parts; s3fs sends the parts
    concurrently. Other backends take a single write."""
    return location.backend.multipart_options(part_size)


def read_small(location: Location, path: str) -> bytes:
    """The whole content of a small object (a marker) in one GET (on S3 without the HEAD that
    newer s3fs releases send first to decide on concurrent ranges)."""
    return location.backend.read_small(path)


def file_exists(location: Location, path: str) -> bool:
    """Whether one file exists, in one request. (s3fs's ``exists`` follows a missing key's HEAD
    with a LIST to see whether it is a directory.)"""
    return location.backend.file_exists(path)


def read_file(location: Location, path: str) -> bytes:
    """The whole content of a file of any size."""
    return location.backend.read_file(path)


def read_range(location: Location, path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a file in one ranged request (fewer at its end)."""
    return location.backend.read_range(path, start, end)


def open_read(location: Location, path: str, size: int) -> IO[bytes]:
    """A file of known ``size`` open for reading (object stores: in ranged requests, each
    tried again on its own); ``FileNotFoundError`` now if it is missing."""
    return location.backend.open_read(path, size)


def get_file(location: Location, path: str, local_path: str) -> None:
    """Download a file to a local path."""
    location.backend.get_file(path, local_path)


def read_ranges(location: Location, path: str, size: int, chunk: int) -> Iterator[bytes]:
    """A file of known size as consecutive chunks, without first asking the backend its size."""
    return location.backend.read_ranges(path, size, chunk)


def create_exclusive(location: Location, path: str, data: bytes) -> None:
    """Create ``path`` holding ``data`` or raise ``FileExistsError`` if it exists; a reader
    never sees it partly written. Exclusive (a race has exactly one winner) where
    ``location.backend.exclusive_create``: local disk (temp file + hard link), S3 and GCS
    (create-only PUT), memory; elsewhere check-then-put, where the last of two racers wins.
    ``BackendUnavailableError`` naming the bucket or directory if it does not exist."""
    _created(location, path, lambda: location.backend.create_exclusive(path, data))


def put_bytes(location: Location, path: str, data: bytes, part_size: int) -> None:
    """Write one whole file from memory, in parts of ``part_size`` where the backend uploads
    in parts (each tried again on its own)."""
    location.backend.put_bytes(path, data, part_size)


def put_small(location: Location, path: str, data: bytes) -> None:
    """Write a small file with one plain write: not atomic, not exclusive, not synced."""
    location.backend.put_small(path, data)


#: requests ``create_settled`` sends at most before it gives up on settling a create-only write
CREATE_TRIES = 4
#: the pause before the second request; it doubles before each later one
_SETTLE_PAUSE_S = 0.05
#: errors that say the request was refused, so it was not applied (and is not worth repeating)
_REFUSED = (
    PermissionError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    StorageOptionsRefusedError,
)


@dataclass(frozen=True, slots=True)
class CreateOutcome:
    """How ``create_settled`` ended.

    ``existing`` is None when the caller's bytes are at the path (this call created it, or an
    earlier request of this call whose reply was lost did), else the bytes of another
    writer's file there. ``unknown_outcomes`` counts the requests that failed without saying
    whether they were applied: a store may still apply such a request later, so a caller
    whose write may name other data (a commit marker naming a payload) keeps that data.
    """

    existing: bytes | None
    unknown_outcomes: int = 0

    @property
    def created(self) -> bool:
        return self.existing is None


def outcome_unknown(exc: BaseException) -> bool:
    """Whether a failed request may nevertheless have been applied: a transport error, a
    timeout, a reset connection, a 5xx answer (also once a retry policy gave up on them as
    ``BackendUnavailableError``). A refusal (permission, missing bucket or directory, unusable
    options) and an answer such as ``FileExistsError`` are known outcomes."""
    if isinstance(exc, (*_REFUSED, FileExistsError)):
        return False
    if isinstance(exc, BackendUnavailableError):  # judged by what it translated, if anything
        return exc.__cause__ is None or outcome_unknown(exc.__cause__)
    return _is_backend_failure(exc) and not isinstance(exc, TypeError | AttributeError | KeyError)


def create_settled(
    location: Location, path: str, data: bytes, *, tries: int = CREATE_TRIES
) -> CreateOutcome:
    """``create_exclusive`` whose lost reply is settled by reading back: the one way every
    create-only write of Zephon (commit markers, attempt and decision records, ``_CORRUPT``
    records, pipeline parts) is made.

    A create-only write can be applied while its reply is lost (a reset connection, a
    timeout, a 5xx after the server stored it); its caller then sees an error, or, when the
    client retried by itself, ``FileExistsError`` for its own file. Either way the file at
    ``path`` decides: holding exactly ``data``, it is this call's (callers put something
    unique to the writer in ``data``: a save id, an attempt id, a timestamp), so the write
    succeeded; holding other bytes, another writer won (returned for the caller to judge);
    absent, the write did not land and is sent again, up to ``tries`` requests in all (none
    more after a failure the retry policy already tried until its deadline: an outage).

    Raises what the last request raised if it never settled (an error of unknown outcome:
    the file may be there, or still appear), a refusal (``PermissionError``,
    ``FileNotFoundError``...) at once, and ``FileExistsError`` only if something keeps
    refusing the create while ``path`` reads as absent (a POSIX ``.claim`` file left by a
    crashed creator). Translate with ``backend_errors`` around the call, as for the other
    primitives.
    """
    unknown = 0
    last: BaseException | None = None
    for attempt in range(max(tries, 1)):
        if attempt:
            time.sleep(_SETTLE_PAUSE_S * 2 ** (attempt - 1))
        try:
            create_exclusive(location, path, data)  # a missing bucket or directory: refused
            return CreateOutcome(None, unknown)
        except FileExistsError as exc:
            last = exc
        except Exception as exc:
            if not outcome_unknown(exc):
                raise
            last, unknown = exc, unknown + 1
        # A failure the location's retry policy already tried until its deadline is an outage,
        # not a lost reply: read back once, but never send again (that would be the policy's
        # whole deadline once more per try).
        final = retry_summary(last) is not None
        try:
            found = location.backend.read_small(path)
        except FileNotFoundError:
            if final:
                break
            continue  # not there: the create did not land (yet); send it again
        except Exception as exc:
            if not outcome_unknown(exc):
                raise
            if final:
                break
            last = exc  # cannot tell yet, even after a FileExistsError: it may be this call's
            continue
        return CreateOutcome(None if found == data else found, unknown)
    assert last is not None
    raise last
