"""The boundary between the storage layer and fsspec: backend errors translated once, listing
entries normalised, and the few primitive operations whose behaviour differs per backend.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import functools
import inspect
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from storage.errors import BackendUnavailableError, StorageError, StorageOptionsRefusedError
from storage.location import Location
from storage.redact import redact

__all__ = [
    "ListedFile",
    "backend_errors",
    "list_files",
    "mtime_of",
    "multipart_options",
    "read_small",
    "read_ranges",
    "file_exists",
    "remove_empty_dirs",
    "remove_files",
]

_PASSTHROUGH = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
#: backends whose listings filter by key prefix on the server, and whose uploads can be chunked
SERVER_SIDE_PREFIX = frozenset({"s3", "s3a", "gs", "gcs"})
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
        if isinstance(exc, PermissionError):
            fix = "check the credentials and permissions in storage_options"
        elif isinstance(exc, OSError) and exc.errno in {errno.ENOSPC, errno.EDQUOT}:
            fix = "free space or use another save_dir"
        else:
            fix = "check that the endpoint is reachable and storage_options are right"
        raise BackendUnavailableError(f"{what}; {fix}", url=location.url) from exc


@dataclass(frozen=True, slots=True)
class ListedFile:
    """One object or file from a listing: path in the filesystem's form, size, mtime (epoch s)."""

    path: str
    size: int
    mtime: float | None


def mtime_of(info: dict) -> float | None:
    """Modification time of a listing entry, across the keys each backend uses."""
    for key in ("mtime", "LastModified", "updated", "created"):
        value = info.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, dt.datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


def list_files(location: Location, path: str) -> list[ListedFile]:
    """Every file below ``path`` with one listing where the backend allows it (object stores
    list a prefix recursively in pages); an absent path lists as empty."""
    fs = location.fs
    try:
        if location.protocol in SERVER_SIDE_PREFIX:
            # Listing <parent> with prefix "<name>/" is one paged LIST; listing <path> itself
            # would add a HEAD and a second LIST whenever the directory is empty.
            parent, _, name = path.rstrip("/").rpartition("/")
            found = fs.find(parent, detail=True, withdirs=False, prefix=f"{name}/")
        else:
            found = fs.find(path, detail=True, withdirs=False)
    except FileNotFoundError:
        return []
    out = []
    for name, info in found.items():
        if info.get("type") == "directory":
            continue
        out.append(ListedFile(name, int(info.get("size") or 0), mtime_of(info)))
    return out


def remove_files(location: Location, paths: Iterable[str]) -> int:
    """Delete files in as few requests as the backend allows (S3 DeleteObjects: 1000 keys each,
    GCS batch: 100); missing ones are ignored. Returns how many paths were passed."""
    paths = list(paths)
    if not paths:
        return 0
    fs = location.fs
    if location.is_local:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return len(paths)
    try:
        fs.rm(paths)
    except FileNotFoundError:
        # Some backends refuse the whole batch when one key is already gone; finish one by one.
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)
    return len(paths)


def remove_empty_dirs(location: Location, top: str) -> None:
    """Remove now-empty directories under and including ``top`` (POSIX and memory only: object
    stores have no directories to remove)."""
    if location.is_local:
        for dirpath, _dirs, _files in os.walk(top, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)
    elif location.protocol == "memory":
        with contextlib.suppress(FileNotFoundError, OSError):
            location.fs.rm(top, recursive=True)


def multipart_options(location: Location, part_size: int) -> dict:
    """Keyword arguments that make ``pipe_file`` split data of at least two parts into a
    multipart (S3) or resumable (GCS) upload of ``part_size`` parts; s3fs sends the parts
    concurrently. Other backends take a single write."""
    return {"chunksize": part_size} if location.protocol in SERVER_SIDE_PREFIX else {}


def read_small(location: Location, path: str) -> bytes:
    """The whole content of a small object (a marker) in one GET; s3fs releases that take
    ``max_concurrency`` would otherwise HEAD first to decide whether to download in concurrent
    ranges (older ones, such as the 2026.2 that ``datasets`` pins, do one GET anyway)."""
    if location.protocol in {"s3", "s3a"} and _takes_max_concurrency(type(location.fs)):
        return location.fs.cat_file(path, max_concurrency=1)
    return location.fs.cat_file(path)


@functools.cache
def _takes_max_concurrency(filesystem: type) -> bool:
    method = getattr(filesystem, "_cat_file", None) or filesystem.cat_file
    try:
        return "max_concurrency" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def file_exists(location: Location, path: str) -> bool:
    """Whether one file exists, in one request. (s3fs's ``exists`` follows a missing key's HEAD
    with a LIST to see whether it is a directory.)"""
    if location.is_local:
        return os.path.isfile(path)
    if location.protocol in SERVER_SIDE_PREFIX:
        parent, _, name = path.rpartition("/")
        try:
            return path in location.fs.find(parent, prefix=name, withdirs=False)
        except FileNotFoundError:
            return False
    return location.fs.isfile(path)


def read_ranges(location: Location, path: str, size: int, chunk: int) -> Iterator[bytes]:
    """A file of known size as consecutive chunks, without first asking the backend its size."""
    if location.is_local:
        with open(path, "rb") as handle:
            while piece := handle.read(chunk):
                yield piece
        return
    if size == 0:
        yield read_small(location, path)
        return
    for start in range(0, size, chunk):
        yield location.fs.cat_file(path, start=start, end=min(start + chunk, size))
