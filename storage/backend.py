"""The boundary between the storage layer and fsspec: backend errors translated once, and the
few primitive operations whose behaviour differs per backend, each a call of the location's
``Backend`` (``storage.backends``: one class per family of filesystems, chosen once when the
location was opened). Everything in the storage layer (and zephon, through ``storage``) calls
these functions; what differs between backends lives only in the backend classes.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from storage.backends.base import ListedFile, mtime_of
from storage.errors import BackendUnavailableError, StorageError, StorageOptionsRefusedError
from storage.redact import redact

if TYPE_CHECKING:
    from storage.location import Location

__all__ = [
    "ListedFile",
    "backend_errors",
    "create_exclusive",
    "file_exists",
    "list_files",
    "make_dirs",
    "mtime_of",
    "multipart_options",
    "put_small",
    "read_ranges",
    "read_small",
    "remove_dir",
    "remove_empty_dirs",
    "remove_files",
    "sync_dirs",
]

_PASSTHROUGH = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "google", "requests", "urllib3")
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
        what = f"{action} failed on {location.url}: {type(exc).__name__}: "
        what += redact(exc, location.secrets)
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
# location was opened. One call style everywhere: ``operation(location, path, ...)``.


def list_files(location: Location, path: str, *, prefix: str = "") -> list[ListedFile]:
    """Every file below ``path`` with one listing where the backend allows it (object stores
    list a prefix recursively in pages); an absent path lists as empty. ``prefix`` keeps only
    the files whose first path component below ``path`` starts with it (filtered by the server
    where it can)."""
    return location.backend.list_files(path, prefix=prefix)


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


def put_small(location: Location, path: str, data: bytes) -> None:
    """Write a small file with one plain write: not atomic, not exclusive, not synced."""
    location.backend.put_small(path, data)
