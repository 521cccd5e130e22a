"""Files written into one save's payload directory, their size and CRC32C recorded as they go.

``PayloadWriter`` is the writing half of ``storage.writer.CheckpointWriter``: it claims each
name once, sends the bytes through the backend (local disk: fsynced; object stores: one PUT or
a multipart upload) and records the file's entry only once the store acknowledged it, never by
reading the bytes back. The entries it records are what a commit's manifest lists; the commit,
the entries of other writers and ``abort`` live in ``storage.writer``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from typing import BinaryIO

from zephon.storage.backend import copy_file, make_dirs, open_read, same_store
from zephon.storage.checksum import Crc32c
from zephon.storage.chunked_file import ChunkedFile, SaveChunks
from zephon.storage.chunks import CHUNK_SCOPES, DEFAULT_MAX_CHUNK, ChunkRef
from zephon.storage.errors import InvalidArgumentError, InvalidNameError, WriteAbortedError
from zephon.storage.layout import RunLayout, validate_file_name
from zephon.storage.location import Location
from zephon.storage.manifest import FileEntry, validate_save_id
from zephon.storage.recording import ChecksummedReader, RecordingFile

__all__ = ["Payload", "PayloadWriter"]

#: What ``write_many`` accepts per file: bytes-like data, a local file path, or a readable stream.
Payload = bytes | bytearray | memoryview | str | os.PathLike | BinaryIO

_CHUNK = 8 << 20


class PayloadWriter:
    """Writes files into ``save-<step>/<save_id>/`` of one run and records their entries.

    Thread-safe: files may be written from many threads at once. ``_state`` is ``"open"``
    while files may be written; the subclass moves it on (committed, aborted, ...).
    """

    def __init__(
        self,
        location: Location,
        layout: RunLayout,
        step: int,
        save_id: str,
        *,
        part_size: int,
        executor: Callable[[], Executor],
    ) -> None:
        """``part_size``: bytes per multipart part; ``executor``: the store's thread pool,
        made on first use (``write_many``)."""
        self._location = location
        self._layout = layout
        self._part_size = part_size
        self._executor = executor
        self.run = layout.run
        self.step = step
        self.save_id = validate_save_id(save_id)
        #: the step directory (``save-<step>``) and its URL, as messages and DCP name it
        self.path = layout.checkpoint_path(step)
        self.url = location.display(self.path)
        #: where this save's files go
        self.payload_path = layout.payload_path(step, self.save_id)
        self._entries: dict[str, FileEntry] = {}
        self._own: set[str] = set()  # names this writer wrote itself (not add_entries)
        self._lock = threading.Lock()
        self._dirs: set[str] = {self.payload_path, self.path}
        self._chunks: SaveChunks | None = None  # deduplicate()
        #: where a deduplicated save's chunks go (``deduplicate``)
        self.chunk_scope = "run"
        self._state = "open"

    # -- writing -------------------------------------------------------------------------------

    @property
    def entries(self) -> list[FileEntry]:
        """Every file this writer knows about, its own and those added from other writers."""
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.name)

    def write_bytes(self, name: str, data: bytes | bytearray | memoryview) -> FileEntry:
        """Write one file from memory."""
        target = self._claim(name)
        location = self._location
        with self._guard(name):
            if location.backend.posix_paths:
                # An OS file: written and checksummed in writeback pieces, while they are hot.
                with self._open_file(target) as out:
                    out.write(data)
                return self._record(name, out.crc)
            crc = Crc32c()
            crc.update(data)
            # the caller's buffer as it is (no copy where the backend reads it in place), and
            # the CRC32C for the store to check where it can
            location.backend.put_buffer(target, data, self._part_size, crc.encoded())
            return self._record(name, crc)

    def write_stream(self, name: str, stream: BinaryIO) -> FileEntry:
        """Write one file from a readable binary stream, in bounded-memory chunks."""
        with self.open(name) as out:
            while chunk := stream.read(_CHUNK):
                out.write(chunk)
        return self._entries[name]

    def put_file(self, name: str, local_path: str | os.PathLike) -> FileEntry:
        """Copy one local file into the checkpoint."""
        with open(local_path, "rb") as stream:
            return self.write_stream(name, stream)

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[RecordingFile]:
        """A file to ``write()`` into; recorded in the manifest when the block exits cleanly.

        Large files on object stores go out as multipart uploads as the buffer fills.
        """
        target = self._claim(name)
        with self._guard(name):
            with self._open_file(target) as out:
                yield out
            self._record(name, out.crc)

    def deduplicate(
        self,
        base: Mapping[str, ChunkRef],
        *,
        max_chunk: int = DEFAULT_MAX_CHUNK,
        scope: str = "run",
    ) -> None:
        """Write the files of ``open_chunked`` as content-addressed chunks from now on,
        listing ``base``'s instance (SHA-256 hex -> ``ChunkRef``) instead of uploading the
        same content again. ``base`` must come from the newest committed checkpoint of this
        save's history (``Manifest.chunk_refs``), which retention keeps, or from a checkpoint
        the commit re-checks (``CheckpointWriter.keep_base``); docs/dedup.md. ``scope``: where
        the chunks go (``storage.chunks.CHUNK_SCOPES``)."""
        self._check_open()
        if scope not in CHUNK_SCOPES:
            raise InvalidArgumentError(
                f"chunk scope {scope!r} is not one of {', '.join(CHUNK_SCOPES)}"
            )
        self.chunk_scope = scope
        self._chunks = SaveChunks(
            self._location,
            self._location.chunk_dir(scope, self.run),
            self.save_id,
            base,
            part_size=self._part_size,
            max_chunk=max_chunk,
        )
        with self._lock:
            self._dirs.add(self._chunks.chunk_dir)

    @property
    def chunk_stats(self) -> tuple[int, int]:
        """``(uploaded, reused)`` chunk bytes of this writer's deduplicated files so far."""
        chunks = self._chunks
        return (chunks.uploaded_bytes, chunks.reused_bytes) if chunks else (0, 0)

    @contextlib.contextmanager
    def open_chunked(self, name: str) -> Iterator[ChunkedFile]:
        """A file to ``write()`` into as ``open``, stored as chunks once ``deduplicate`` was
        called (plain otherwise: the caller need not tell the two apart)."""
        if self._chunks is None:
            with self.open(name) as out:
                yield out  # type: ignore[misc]
            return
        self._claim_name(name)
        with self._guard(name):
            out = ChunkedFile(self._chunks)
            try:
                yield out
            except BaseException:
                out.discard()
                raise
            refs = out.finish()
            entry = FileEntry(name, out.crc.size, out.crc.encoded(), refs)
            with self._lock:
                self._entries[name] = entry

    def can_copy_from(self, source: Location) -> bool:
        """Whether ``copy_from`` can copy files of ``source`` into this save on the server."""
        return same_store(self._location, source)

    def copy_from(
        self,
        source: Location,
        path: str,
        name: str,
        size: int,
        read: Callable[[BinaryIO], None] | None = None,
    ) -> FileEntry:
        """Copy the file ``path`` of ``source`` (``size`` bytes) into this save as ``name`` on
        the server (only where ``can_copy_from``), then read the copy back once for its size
        and CRC32C: what the manifest records are the copy's own bytes. ``read``, if given,
        gets that stream first, from its start (e.g. to parse the file on the way).
        ``WriteAbortedError`` if the copy does not hold ``size`` bytes."""
        target = self._claim(name)
        location = self._location
        with self._guard(name):
            copy_file(location, path, target)
            with open_read(location, target, size) as handle:
                stream = ChecksummedReader(handle)
                if read is not None:
                    read(stream)
                while stream.read(_CHUNK):
                    pass
            if stream.crc.size != size:
                raise WriteAbortedError(
                    f"copy of {source.display(path)} into {self.url} holds {stream.crc.size} "
                    f"bytes, not {size}: the source changed while it was copied; copy again",
                    run=self.run,
                    step=self.step,
                )
            return self._record(name, stream.crc)

    def write_many(self, files: Mapping[str, Payload]) -> list[FileEntry]:
        """Write several files in parallel on the store's thread pool; returns their entries.

        On the first failure the remaining writes still finish or fail, then the first error
        is raised; the checkpoint stays uncommitted either way.
        """
        pool = self._executor()
        futures = [pool.submit(self._write_any, name, payload) for name, payload in files.items()]
        results, first_error = [], None
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below after all finish
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

    # -- internals -----------------------------------------------------------------------------

    def _write_any(self, name: str, payload: Payload) -> FileEntry:
        if isinstance(payload, bytes | bytearray | memoryview):
            return self.write_bytes(name, payload)
        if isinstance(payload, str | os.PathLike):
            return self.put_file(name, payload)
        return self.write_stream(name, payload)

    def _check_open(self) -> None:
        if self._state != "open":
            raise WriteAbortedError(
                f"writer for {self.url} is {self._state}; begin a new checkpoint to write again",
                run=self.run,
                step=self.step,
            )

    def _claim_name(self, name: str) -> None:
        self._check_open()
        validate_file_name(name)
        with self._lock:
            if name in self._own or name in self._entries:
                raise InvalidNameError(
                    f"file {name!r} was already written to {self.url}; each name is written once",
                    run=self.run,
                    step=self.step,
                    path=name,
                )
            self._own.add(name)

    def _claim(self, name: str) -> str:
        self._claim_name(name)
        target = f"{self.payload_path}/{name}"
        location = self._location
        if location.backend.has_directories:
            parent = target.rsplit("/", 1)[0]
            make_dirs(location, parent)
            with self._lock:  # the directories whose entries the commit makes durable
                while parent.startswith(self.payload_path) and parent not in self._dirs:
                    self._dirs.add(parent)
                    parent = parent.rsplit("/", 1)[0]
        return target

    @contextlib.contextmanager
    def _guard(self, name: str) -> Iterator[None]:
        """On failure, forget the claimed name so the caller may retry it (the backend
        translated the failure)."""
        try:
            yield
        except BaseException:
            with self._lock:
                self._own.discard(name)
                self._entries.pop(name, None)
            raise

    def _record(self, name: str, crc: Crc32c) -> FileEntry:
        entry = FileEntry(name=name, size=crc.size, crc32c=crc.encoded())
        with self._lock:
            self._entries[name] = entry
        return entry

    @contextlib.contextmanager
    def _open_file(self, target: str) -> Iterator[RecordingFile]:
        """The payload file ``target`` open for writing through the backend: completed (local
        disk: fsynced; object stores: the upload finished) when the block exits cleanly,
        abandoned without publishing anything otherwise."""
        backend = self._location.backend
        part_size = self._part_size
        out = RecordingFile(backend.open_write(target, part_size), backend, part_size)
        try:
            yield out
        except BaseException:
            out.discard()
            raise
        out.finish()
