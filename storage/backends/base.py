"""The generic backend: any fsspec filesystem, through fsspec calls alone.

A ``Backend`` holds one fsspec filesystem and carries out the few primitive operations the
storage layer needs (list, delete, read small, read in ranges, check existence, write a file,
create a marker exclusively). Subclasses for particular families of filesystems override the
primitives they can do better and set the capability flags that say so; callers ask the flags
("can a marker race have two winners?"), never the protocol.

Every call of a primitive goes through the backend's retry policy (``storage.retry``): the
public method tries its ``_``-named implementation again on transient failures, and a
subclass implements the ``_``-named one (``__init_subclass__`` refuses an override of the
public one, which would bypass the policy).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, ClassVar

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from zephon.storage.backends.handles import (
    OPEN_READ_BLOCK,
    RangedReader,
    TranslatedReader,
    WriteHandle,
)
from zephon.storage.backends.translate import translated
from zephon.storage.redact import mask_url
from zephon.storage.retry import DEFAULT_RETRY, RetryPolicy

__all__ = [
    "OPEN_READ_BLOCK",
    "RETRIED_PRIMITIVES",
    "STREAM_REQUEST_BYTES",
    "TRANSLATED_OPERATIONS",
    "TranslatedReader",
    "Backend",
    "ListedFile",
    "mtime_of",
]

#: the largest request of ``read_range_stream`` on the fsspec path, which joins a whole reply
#: into one bytes object: what one reading thread holds at most there
STREAM_REQUEST_BYTES = 16 << 20
#: the primitives every call of which goes through the backend's retry policy: a subclass
#: implements ``_<name>``, never ``<name>`` itself
RETRIED_PRIMITIVES = (
    "list_files",
    "list_dirs",
    "file_exists",
    "read_small",
    "read_file",
    "read_range",
    "read_range_into",
    "read_range_stream",
    "get_file",
    "put_bytes",
    "put_buffer",
    "put_small",
    "create_exclusive",
    "remove_files",
    "copy_file",
)
#: every public operation: its errors are translated (``storage.backends.translate``), so a
#: subclass implements ``_<name>``, never ``<name>`` itself
TRANSLATED_OPERATIONS = (
    *RETRIED_PRIMITIVES,
    "is_dir",
    "make_dirs",
    "sync_dirs",
    "remove_dir",
    "remove_empty_dirs",
    "read_ranges",
    "open_read",
    "open_write",
    "finish_write",
    "discard_write",
)


@dataclass(frozen=True, slots=True)
class ListedFile:
    """One object or file from a listing: path in the filesystem's form, size, mtime (epoch s)."""

    path: str
    size: int
    mtime: float | None


def mtime_of(info: Mapping[str, Any]) -> float | None:
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


def _listed(found: Mapping[str, Mapping[str, Any]]) -> list[ListedFile]:
    return [
        ListedFile(name, int(info.get("size") or 0), mtime_of(info))
        for name, info in found.items()
        if info.get("type") != "directory"
    ]


class Backend:
    """Any fsspec filesystem: check-then-put markers (not exclusive), fsspec calls throughout.

    Subclass it for a family of filesystems, override the primitives it does better, set the
    flags, and register the class in ``storage.backends.registry``.
    """

    #: the fsspec protocols this class serves (the registry's keys)
    protocols: ClassVar[tuple[str, ...]] = ()
    #: the package providing the fsspec implementation, for the install hint
    package: ClassVar[str | None] = None
    #: the storage options that take credentials, for backends that read none from the URL
    #: (a ``user:pw@`` there would become part of the bucket name): such URLs are refused
    url_credentials_go_in: ClassVar[str | None] = None
    #: environment variables the library reads credentials from: their values are scrubbed
    #: from messages like those of the storage options
    secret_environment: ClassVar[tuple[str, ...]] = ()
    #: what the library needs to open a URL, for a library that refuses to open one without
    #: it (with a ``ValueError``); None: such an error means the URL itself is wrong
    options_needed: ClassVar[str | None] = None
    #: what the backend calls the top level of a path (named in "create it first" fixes)
    bucket_word: ClassVar[str] = "bucket"

    # -- capability flags: what callers may ask -----------------------------------------------

    #: the backend itself refuses a second create of a marker: a race has exactly one winner
    exclusive_create: ClassVar[bool] = False
    #: paths are plain OS paths: ``os`` calls, hard links and fsync may be used on them
    posix_paths: ClassVar[bool] = False
    #: directories are real entries, left behind when their files go (so they are removed)
    has_directories: ClassVar[bool] = False
    #: a listing can filter by key prefix on the server (one paged LIST for a whole subtree)
    server_side_prefix: ClassVar[bool] = False
    #: large writes go out in parts of ``part_size`` (multipart or resumable uploads)
    multipart_uploads: ClassVar[bool] = False
    #: copies a file to another path of the same store on the server (S3 CopyObject, GCS
    #: rewrite), its bytes never passing through this process (``copy_file``)
    server_side_copy: ClassVar[bool] = False
    #: other processes (and machines) see what this process writes
    cross_process: ClassVar[bool] = True
    #: ``CheckpointStore.max_workers`` by default: threads per checkpoint read or write. Where
    #: each request mostly waits for its answer, as many as the connection pool.
    default_workers: ClassVar[int] = 32

    def __init__(
        self,
        fs: AbstractFileSystem,
        protocol: str,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        root: str = "",
        url: str | None = None,
        secrets: frozenset[str] = frozenset(),
        role: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.fs = fs
        #: the storage_options the location was opened with (before the backend's defaults);
        #: kept for what reads options fsspec never sees (``native``), never shown
        self.options: Mapping[str, Any] = dict(options or {})
        self.protocol = protocol
        #: how transient failures of every primitive are tried again (``storage.retry``)
        self.retry = retry
        #: the location's root path, masked URL (named by every error), the credential values
        #: scrubbed from backend texts, and the setting it came from (named by fixes)
        self.root = root
        self.url = url if url is not None else self.display(root)
        self.secrets = secrets
        self.role = role

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        bypassing = [name for name in TRANSLATED_OPERATIONS if name in cls.__dict__]
        if bypassing:
            raise TypeError(
                f"{cls.__name__} overrides {bypassing[0]}, which would bypass the retry "
                f"policy or the translation of errors: implement _{bypassing[0]} instead"
            )

    def __repr__(self) -> str:
        # Never the filesystem: its attributes hold credentials.
        return f"{type(self).__name__}({self.protocol!r})"

    @classmethod
    def default_options(cls, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
        """``storage_options`` with this backend's defaults added where the user set nothing
        (before the filesystem is made)."""
        return dict(storage_options or {})

    @classmethod
    def normalise_root(cls, fs: AbstractFileSystem, root: str) -> str:
        """The root path as ``url_to_fs`` returned it, in the form every other path takes."""
        return root

    # -- paths ---------------------------------------------------------------------------------

    def display(self, path: str) -> str:
        """A full, credential-free URL for a path of this filesystem, for messages."""
        if "://" in path:  # HTTP keeps whole URLs as paths
            return mask_url(path)
        return mask_url(f"{self.protocol}://{path.lstrip('/')}")

    def forget_cached(self, path: str) -> None:
        """Drop what the filesystem cached about ``path`` and below (listings), so that the
        next call asks the backend (another process may have written there)."""
        self.fs.invalidate_cache(path)

    # -- the operations: each public one translates the errors of its ``_``-named
    # implementation (``storage.backends.translate``); the primitives among them also try it
    # again through ``self.retry``. Subclasses override the implementations
    # (``__init_subclass__`` refuses an override of a public one).

    def _doing(self, verb: str, path: str, *, creating: bool = False) -> Any:
        """The translation of errors while doing ``verb`` to ``path``."""
        return translated(self, f"{verb} {self.display(path)}", creating=creating)

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory (or, on object stores, a prefix with keys below)."""
        with self._doing("looking for", path):
            return self.retry.call(self._is_dir, path)

    def make_dirs(self, path: str, *, durable: bool = False) -> None:
        """Make the directory ``path`` and its parents where the backend needs them before
        files are written into it (``durable``: survive a power loss); a no-op elsewhere.
        ``BackendUnavailableError`` if the directory cannot exist there."""
        with self._doing("creating", path, creating=True):
            self._make_dirs(path, durable=durable)

    def sync_dirs(self, paths: Iterable[str]) -> None:
        """Make the entries of these directories durable (POSIX fsync); a no-op elsewhere."""
        paths = list(paths)
        with self._doing("syncing", paths[0] if paths else self.root):
            self._sync_dirs(paths)

    def remove_dir(self, path: str) -> None:
        """Remove ``path`` if it is an empty directory; nothing else is ever removed."""
        with self._doing("removing", path):
            self._remove_dir(path)

    def remove_empty_dirs(self, top: str) -> None:
        """Remove now-empty directories under and including ``top`` once their files went."""
        with self._doing("removing", top):
            self._remove_empty_dirs(top)

    def list_files(self, path: str, *, prefix: str = "") -> list[ListedFile]:
        """Every file below ``path`` (only those whose first path component below it starts
        with ``prefix``), with one listing where the backend allows; absent lists as empty."""
        with self._doing("listing", path):
            return self.retry.call(self._list_files, path, prefix=prefix)

    def list_dirs(self, path: str) -> list[str]:
        """The names of the directories directly below ``path`` (one delimited listing);
        absent lists as empty."""
        with self._doing("listing", path):
            return self.retry.call(self._list_dirs, path)

    def file_exists(self, path: str) -> bool:
        """Whether one file exists, in one request."""
        with self._doing("checking", path):
            return self.retry.call(self._file_exists, path)

    def read_small(self, path: str) -> bytes:
        """The whole content of a small file (a marker) in one request."""
        with self._doing("reading", path):
            return self.retry.call(self._read_small, path)

    def read_file(self, path: str) -> bytes:
        """The whole content of a file of any size."""
        with self._doing("reading", path):
            return self.retry.call(self._read_file, path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file in one ranged request (fewer at its end)."""
        with self._doing("reading", path):
            return self.retry.call(self._read_range, path, start, end)

    def read_range_into(self, path: str, start: int, buffer: Any) -> int:
        """Bytes of a file from ``start`` straight into ``buffer`` (any writable C-contiguous
        buffer: a tensor's bytes), as many as it holds, in one ranged request; returns how
        many arrived (fewer at the file's end). Where the backend can, no bytes object is made
        on the way."""
        with self._doing("reading", path):
            return self.retry.call(self._read_range_into, path, start, buffer)

    def read_range_stream(
        self, path: str, start: int, end: int, sink: Callable[[memoryview], None]
    ) -> int:
        """Bytes ``[start, end)`` of a file handed to ``sink`` in order, chunk by chunk, as they
        arrive (``_range_chunks``: one streamed ranged request where the backend can, so a
        store that reads a whole object per request reads it once); returns how many arrived
        (fewer at the file's end). A failure part-way is tried again by the retry policy from
        the first byte not yet handed over, so ``sink`` sees every byte once, in order. A chunk
        is valid only during its call to ``sink``."""
        delivered = 0

        def rest() -> int:
            nonlocal delivered
            for chunk in self._range_chunks(path, start + delivered, end):
                sink(chunk)
                delivered += chunk.nbytes
            return delivered

        with self._doing("reading", path):
            return self.retry.call(rest)

    def get_file(self, path: str, local_path: str) -> None:
        """Download a file to a local path."""
        with self._doing("downloading", path):
            self.retry.call(self._get_file, path, local_path)

    def put_bytes(self, path: str, data: bytes, part_size: int) -> None:
        """Write one whole file from memory (durable when this returns)."""
        with self._doing("writing", path, creating=True):
            self.retry.call(self._put_bytes, path, data, part_size)

    def put_buffer(self, path: str, data: Any, part_size: int, crc32c: str | None = None) -> None:
        """Write one whole file from any C-contiguous buffer (a tensor's bytes, a memoryview),
        durable when this returns; read in place where the backend can (no copy).
        ``crc32c``: the data's CRC32C (``storage.checksum`` form), which the backend sends for
        the store to check where it can (S3 ``x-amz-checksum-crc32c`` on a single PUT)."""
        with self._doing("writing", path, creating=True):
            self.retry.call(self._put_buffer, path, data, part_size, crc32c)

    def put_small(self, path: str, data: bytes) -> None:
        """Write a small file with one plain write: not atomic, not exclusive, not synced
        (an acknowledgement, whose content nobody reads)."""
        with self._doing("writing", path, creating=True):
            self.retry.call(self._put_small, path, data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create ``path`` holding ``data``, or raise ``FileExistsError`` if it exists; a
        reader never sees it partly written. A try whose reply was lost is tried again and
        then finds the file there: ``FileExistsError`` as well, which is never tried again
        (the commit tells its own marker from another's). ``BackendUnavailableError`` naming
        the bucket or directory if it does not exist."""
        with self._doing("creating", path, creating=True):
            self.retry.call(self._create_exclusive, path, data)

    def copy_file(self, source: str, target: str) -> None:
        """Copy ``source`` to ``target`` of this store on the server, where the backend can
        (``server_side_copy``; elsewhere ``NotImplementedError``): durable when this returns.
        ``FileNotFoundError`` if ``source`` is missing."""
        if not self.server_side_copy:
            raise NotImplementedError(f"{type(self).__name__} has no server-side copy")
        with self._doing("copying to", target):
            self.retry.call(self._copy_file, source, target)

    def remove_files(self, paths: Iterable[str]) -> int:
        """Delete files in as few requests as the backend allows; missing ones are ignored.
        Returns how many paths were passed."""
        paths = list(paths)
        if not paths:
            return 0
        with self._doing("removing", paths[0] if len(paths) == 1 else _common_dir(paths)):
            self.retry.call(self._remove_files, paths)
        return len(paths)

    def read_ranges(self, path: str, size: int, chunk: int) -> Iterator[bytes]:
        """A file of known ``size`` as consecutive chunks, without asking its size first;
        each chunk is one request, tried again on its own."""
        chunks = self._read_ranges(path, size, chunk)
        while True:
            with self._doing("reading", path):
                piece = next(chunks, None)
            if piece is None:
                return
            yield piece

    def open_read(self, path: str, size: int) -> IO[bytes]:
        """A file of known ``size`` open for reading; ``FileNotFoundError`` now if it is
        missing."""
        with self._doing("opening", path):
            return self._open_read(path, size)

    def open_write(self, path: str, part_size: int) -> IO[bytes]:
        """A file to stream one payload file into; ``finish_write`` or ``discard_write`` it.
        Its writes translate their errors as every operation does."""
        with self._doing("writing", path, creating=True):
            handle = self._open_write(path, part_size)
        return WriteHandle(self, handle, path)  # type: ignore[return-value]

    def finish_write(self, handle: IO[bytes]) -> None:
        """Complete a file from ``open_write``: durable and visible when this returns."""
        if isinstance(handle, WriteHandle):
            with self._doing("writing", handle.path, creating=True):
                self._finish_write(handle.raw_handle)
        else:
            self._finish_write(handle)

    def discard_write(self, handle: IO[bytes]) -> None:
        """Abandon a file from ``open_write``, leaving nothing of it behind."""
        self._discard_write(handle.raw_handle if isinstance(handle, WriteHandle) else handle)

    # -- the implementations: one try each -----------------------------------------------------

    def _list_files(self, path: str, *, prefix: str = "") -> list[ListedFile]:
        try:
            found = self.fs.find(path, detail=True, withdirs=False)
        except FileNotFoundError:
            return []
        listed = _listed(found)
        if not prefix:
            return listed
        head = f"{path.rstrip('/')}/{prefix}"
        return [f for f in listed if f.path.startswith(head)]

    def _list_dirs(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return [
            info["name"].rstrip("/").rsplit("/", 1)[-1]
            for info in entries
            if info.get("type") == "directory"
        ]

    def _file_exists(self, path: str) -> bool:
        return self.fs.isfile(path)

    def _read_small(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def _read_file(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def _read_range_into(self, path: str, start: int, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._read_range(path, start, start + view.nbytes)
        count = len(data)
        view[:count] = data
        return count

    def _range_chunks(self, path: str, start: int, end: int) -> Iterator[memoryview]:
        # fsspec joins a whole reply into one bytes object: ranges of STREAM_REQUEST_BYTES
        # bound what a reading thread holds.
        for begin in range(start, end, STREAM_REQUEST_BYTES):
            stop = min(begin + STREAM_REQUEST_BYTES, end)
            data = self._read_range(path, begin, stop)
            if data:
                yield memoryview(data)
            if len(data) < stop - begin:
                return

    def _get_file(self, path: str, local_path: str) -> None:
        self.fs.get_file(path, local_path)

    def _put_buffer(self, path: str, data: Any, part_size: int, crc32c: str | None) -> None:
        self._put_bytes(path, data if isinstance(data, bytes) else bytes(data), part_size)

    def _put_bytes(self, path: str, data: bytes, part_size: int) -> None:
        self.fs.pipe_file(path, data, **self.multipart_options(part_size))

    def _put_small(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def _create_exclusive(self, path: str, data: bytes) -> None:
        # Check, then write. Two creators racing inside the gap can both succeed (the last
        # write wins): ``exclusive_create`` is False. Use S3, GCS or a POSIX file system
        # where that matters.
        if self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.pipe_file(path, data)

    def _copy_file(self, source: str, target: str) -> None:
        self.fs.cp_file(source, target)

    def _remove_files(self, paths: list[str]) -> None:
        try:
            self.fs.rm(paths)
        except FileNotFoundError:
            # Some backends refuse the whole batch when one is already gone: one by one.
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)

    def _is_dir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def _make_dirs(self, path: str, *, durable: bool = False) -> None:
        """Nothing to make where directories are implicit."""

    def _sync_dirs(self, paths: list[str]) -> None:
        """Nothing to sync where directory entries are not files."""

    def _remove_dir(self, path: str) -> None:
        """Nothing to remove where directories are implicit."""

    def _remove_empty_dirs(self, top: str) -> None:
        """Nothing to remove where directories are implicit."""

    def _read_ranges(self, path: str, size: int, chunk: int) -> Iterator[bytes]:
        if size == 0:
            yield self.read_small(path)
            return
        for start in range(0, size, chunk):
            yield self.read_range(path, start, min(start + chunk, size))

    def _open_read(self, path: str, size: int) -> IO[bytes]:
        # Read in ranged requests of ``OPEN_READ_BLOCK`` bytes (each tried again on its own);
        # the first is read here, so a missing file raises ``FileNotFoundError`` now.
        handle = io.BufferedReader(RangedReader(self, path, size), OPEN_READ_BLOCK)
        handle.peek(1)
        return handle

    # -- writing and deleting ------------------------------------------------------------------

    def multipart_options(self, part_size: int) -> dict[str, Any]:
        """Keyword arguments for ``pipe_file`` that upload data of two parts or more in parts
        of ``part_size``; empty where the backend takes a single write."""
        return {}

    def _open_write(self, path: str, part_size: int) -> IO[bytes]:
        return self.fs.open(path, "wb", block_size=part_size)

    def _finish_write(self, handle: IO[bytes]) -> None:
        handle.close()

    def _discard_write(self, handle: IO[bytes]) -> None:
        if isinstance(handle, AbstractBufferedFile):  # nothing is published before close
            # Closing would publish a partial object: drop the upload and mark the handle
            # closed so neither close() nor its finaliser flushes what was buffered.
            with contextlib.suppress(Exception):
                handle.discard()
            with contextlib.suppress(Exception):
                handle.closed = True  # type: ignore[misc]
            return
        # A file that exists from the moment it is opened (memory, local): remove it.
        with contextlib.suppress(Exception):
            handle.close()
        path = getattr(handle, "path", None)
        if isinstance(path, str):
            with contextlib.suppress(OSError):
                self.fs.rm_file(path)


def _common_dir(paths: list[str]) -> str:
    """The directory holding all of ``paths``, to name a batch of them in a message."""
    head = paths[0].rsplit("/", 1)[0]
    while head and not all(p.startswith(f"{head}/") for p in paths):
        head = head.rsplit("/", 1)[0] if "/" in head else ""
    return head or paths[0]
