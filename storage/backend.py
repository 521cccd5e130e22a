"""The few primitive operations whose behaviour differs per backend, each a call of the
location's ``Backend`` (``storage.backends``: one class per family of filesystems, chosen once
when the location was opened), and ``create_settled``, the create-only write whose lost reply
is settled by reading back. The backend classes are the only code that calls fsspec, and
they translate its errors once (``storage.backends.translate``): every function here raises a
``StorageError`` naming the location's URL, or the file-level ``FileNotFoundError`` and
``FileExistsError`` answers for the caller to interpret.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from zephon.storage.backends.base import ListedFile, mtime_of
from zephon.storage.backends.translate import is_backend_failure
from zephon.storage.errors import BackendUnavailableError, StorageOptionsRefusedError
from zephon.storage.retry import retry_summary

if TYPE_CHECKING:
    from zephon.storage.location import Location

__all__ = [
    "CreateOutcome",
    "ListedFile",
    "copy_file",
    "create_exclusive",
    "create_settled",
    "file_exists",
    "forget_cached",
    "get_file",
    "is_dir",
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
    "same_store",
    "sync_dirs",
]

# -- the primitives: each asks the location's backend (storage.backends), chosen when the
# location was opened, which tries transient failures again under its policy
# (``location.retry``) and translates its errors. One call style everywhere:
# ``operation(location, path, ...)``.


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
    location.backend.make_dirs(path, durable=durable)


def sync_dirs(location: Location, paths: Iterable[str]) -> None:
    """Make the entries of these directories durable (local disk: fsync); a no-op elsewhere."""
    location.backend.sync_dirs(paths)


def multipart_options(location: Location, part_size: int) -> dict:
    """Keyword arguments that make ``pipe_file`` split data of at least two parts into a
    multipart (S3) or resumable (GCS) upload of ``part_size`` parts; s3fs sends the parts
    concurrently. Other backends take a single write."""
    return location.backend.multipart_options(part_size)


def same_store(location: Location, other: Location) -> bool:
    """Whether ``copy_file`` copies between these two locations on the server: one store
    (the same filesystem, endpoint and credentials) whose backend can (``server_side_copy``)."""
    return (
        location.backend.server_side_copy
        and type(location.backend) is type(other.backend)
        and location.fs == other.fs
    )


def copy_file(location: Location, source: str, target: str) -> None:
    """Copy ``source`` to ``target`` on the server (both paths of ``location``'s store; only
    where ``same_store`` said so): the bytes never pass through this process."""
    location.backend.copy_file(source, target)


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


def is_dir(location: Location, path: str) -> bool:
    """Whether ``path`` is a directory (on object stores: a prefix with keys below it)."""
    return location.backend.is_dir(path)


def forget_cached(location: Location, path: str) -> None:
    """Drop what the location's filesystem cached about ``path`` and below, so that the next
    listing asks the backend (another process may have written there)."""
    location.backend.forget_cached(path)


def read_ranges(location: Location, path: str, size: int, chunk: int) -> Iterator[bytes]:
    """A file of known size as consecutive chunks, without first asking the backend its size."""
    return location.backend.read_ranges(path, size, chunk)


def create_exclusive(location: Location, path: str, data: bytes) -> None:
    """Create ``path`` holding ``data`` or raise ``FileExistsError`` if it exists; a reader
    never sees it partly written. Exclusive (a race has exactly one winner) where
    ``location.backend.exclusive_create``: local disk (temp file + hard link), S3 and GCS
    (create-only PUT), memory; elsewhere check-then-put, where the last of two racers wins.
    ``BackendUnavailableError`` naming the bucket or directory if it does not exist."""
    location.backend.create_exclusive(path, data)


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
    refusals = TypeError | AttributeError | KeyError | NotImplementedError
    return is_backend_failure(exc) and not isinstance(exc, refusals)


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
    crashed creator); a failure of the backend is a ``BackendUnavailableError`` (translated by
    the backend, as for every primitive).
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
