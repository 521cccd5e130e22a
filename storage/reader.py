"""``CheckpointReader``: read access to one committed checkpoint, by the names its manifest
lists, with every whole-file read checked against the manifest's size and CRC32C."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any, BinaryIO, Protocol

from zephon.storage.backend import get_file, open_read, read_file, read_range
from zephon.storage.checksum import Crc32c
from zephon.storage.chunked_read import ChunkedReader, ChunkedStream
from zephon.storage.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
)
from zephon.storage.location import Location
from zephon.storage.manifest import FileEntry, Manifest

__all__ = ["CheckpointReader", "HoldsLocation"]


class HoldsLocation(Protocol):
    """Anything that holds the ``Location`` a checkpoint is under (a ``CheckpointStore``)."""

    @property
    def location(self) -> Location: ...


class CheckpointReader:
    """Read access to one committed checkpoint, by the names its manifest lists."""

    def __init__(
        self, where: Location | HoldsLocation, manifest: Manifest, *, verify: bool = True
    ) -> None:
        """``where``: the location the checkpoint is under, or what holds it (a store);
        ``manifest``: the checkpoint's, already read and checked (``RunStore.reader``)."""
        location = where if isinstance(where, Location) else where.location
        self._location = location
        self.manifest = manifest
        #: whether ``read_bytes`` compares every file's CRC32C with the manifest
        self.verify = verify
        self._layout = location.run_layout(manifest.run)
        step_path = self._layout.checkpoint_path(manifest.step)
        self.url = location.display(step_path)
        #: the directory holding the files (``save-<step>/<save_id>``; format 1: the step's)
        self.path = f"{step_path}/{manifest.payload}" if manifest.payload else step_path

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.manifest.files]

    def _target(self, name: str) -> str:
        return f"{self.path}/{self._entry(name).name}"

    def _chunked(self, name: str) -> ChunkedReader | None:
        """The chunks of a deduplicated file (None for a plain one)."""
        chunks = self._entry(name).chunks
        if chunks is None:
            return None
        chunk_dir = self._location.chunk_dir(self.manifest.chunk_scope, self.manifest.run)
        return ChunkedReader(self._location, chunk_dir, chunks)

    def _entry(self, name: str) -> FileEntry:
        entry = self.manifest.file(name)
        if entry is None:
            raise CheckpointNotFoundError(
                f"{name!r} is not a file of checkpoint {self.url} (it has {len(self.names)} "
                f"files, e.g. {', '.join(self.names[:3]) or 'none'})",
                url=self.url,
                run=self.manifest.run,
                step=self.manifest.step,
                path=name,
            )
        return entry

    def open(self, name: str) -> BinaryIO:
        """One file open for reading (on object stores in ranged requests, each tried again
        on its own); not checked against the manifest."""
        chunked = self._chunked(name)
        if chunked is not None:
            return io.BufferedReader(ChunkedStream(chunked), 8 << 20)  # type: ignore[return-value]
        target = self._target(name)
        location = self._location
        try:
            return open_read(location, target, self._entry(name).size)  # type: ignore[return-value]
        except FileNotFoundError:
            raise self._missing(name) from None

    def read_bytes(self, name: str) -> bytes:
        """One whole file; with ``verify`` (the default) its size and CRC32C are checked
        against the manifest as it is read, and a mismatch raises ``CorruptCheckpointError``.
        A mismatch is read once more first: a reply damaged in transit is not damage."""
        data = self._read_whole(name)
        if self.verify:
            try:
                self.check(name, data)
            except CorruptCheckpointError:
                data = self._read_whole(name)
                self.check(name, data)
        return data

    def _read_whole(self, name: str) -> bytes:
        chunked = self._chunked(name)
        target = self._target(name)
        location = self._location
        try:
            if chunked is not None:
                return chunked.read_all()
            return read_file(location, target)
        except FileNotFoundError:
            raise self._missing(name) from None

    def check(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Raise ``CorruptCheckpointError`` unless ``data`` is the whole of file ``name`` as
        the manifest describes it (size and CRC32C)."""
        entry = self._entry(name)
        running = Crc32c()
        running.update(data)
        if running.size != entry.size or running.encoded() != entry.crc32c:
            detail = (
                f"{running.size} bytes, the manifest says {entry.size}"
                if running.size != entry.size
                else f"crc32c {running.encoded()}, the manifest says {entry.crc32c}"
            )
            raise self._damaged(
                name,
                f"{name} of checkpoint {self.url} does not match its manifest ({detail}); the "
                "checkpoint is damaged: resume from an earlier checkpoint",
                detail,
            )

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of one file, in one ranged request; fewer bytes than asked
        for means the file is shorter than that (the caller decides if that is damage)."""
        chunked = self._chunked(name)
        target = self._target(name)
        location = self._location
        try:
            if chunked is not None:
                return chunked.read_range(start, end)
            return read_range(location, target, start, end)
        except FileNotFoundError:
            raise self._missing(name) from None

    def read_range_into(self, name: str, start: int, buffer: Any) -> int:
        """Bytes of one file from ``start`` straight into ``buffer`` (any writable
        C-contiguous buffer, e.g. a tensor's bytes), as many as it holds, in one ranged
        request; returns how many arrived (fewer means the file is shorter). No bytes object
        is made on the way where the backend can avoid it (local disk, the native client)."""
        chunked = self._chunked(name)
        target = self._target(name)
        try:
            if chunked is not None:
                return chunked.read_range_into(start, buffer)
            return self._location.backend.read_range_into(target, start, buffer)
        except FileNotFoundError:
            raise self._missing(name) from None

    def read_range_stream(
        self, name: str, start: int, end: int, sink: Callable[[memoryview], None]
    ) -> int:
        """Bytes ``[start, end)`` of one file handed to ``sink`` in order, chunk by chunk, as
        they arrive from one ranged request (on object stores with the native client; the
        fsspec path reads bounded ranges); returns how many arrived (fewer means the file is
        shorter). The chunks are valid only during the call to ``sink``."""
        chunked = self._chunked(name)
        target = self._target(name)
        try:
            if chunked is not None:
                return chunked.read_range_stream(start, end, sink)
            return self._location.backend.read_range_stream(target, start, end, sink)
        except FileNotFoundError:
            raise self._missing(name) from None

    def local_path(self, name: str) -> str | None:
        """The file's path on a local (POSIX) file system, for callers that read it in place
        (e.g. straight into tensor memory); None on object stores."""
        target = self._target(name)
        plain = self._entry(name).chunks is None
        return target if plain and self._location.backend.posix_paths else None

    def open_in_place(self, name: str) -> BinaryIO:
        """One file of a checkpoint on a local (POSIX) file system, open unbuffered for reads
        straight into the caller's memory (``readinto``); not checked against the manifest.
        Only where ``local_path`` is not None."""
        target = self._target(name)
        backend = self._location.backend
        if not backend.posix_paths or self._entry(name).chunks is not None:
            raise InvalidArgumentError(
                f"{self.url} is not on a local file system: read {name} with read_range",
                url=self.url,
            )
        try:
            return backend.open_in_place(target)  # type: ignore[attr-defined]
        except FileNotFoundError:
            raise self._missing(name) from None

    def missing(self, name: str) -> CorruptCheckpointError:
        """The error for a listed file that is not on storage."""
        return self._missing(name)

    def get_file(self, name: str, local_path: str | os.PathLike) -> None:
        chunked = self._chunked(name)
        target = self._target(name)
        location = self._location
        try:
            if chunked is not None:
                with open(local_path, "wb") as out:
                    for path, start, end in chunked.pieces(0, chunked.size):
                        out.write(location.backend.read_range(path, start, end))
                return
            get_file(location, target, os.fspath(local_path))
        except FileNotFoundError:
            raise self._missing(name) from None

    def _missing(self, name: str) -> CorruptCheckpointError:
        return self._damaged(
            name,
            f"{name} of committed checkpoint {self.url} is missing from storage; the checkpoint "
            "is damaged: run `zephon verify` and resume from an earlier checkpoint",
            "missing",
        )

    def _damaged(self, name: str, message: str, problem: str) -> CorruptCheckpointError:
        """The error for file ``name`` of this checkpoint found damaged (``problem``)."""
        return CorruptCheckpointError(
            message,
            url=self.url,
            run=self.manifest.run,
            step=self.manifest.step,
            path=name,
            problems=[f"{name}: {problem}"],
        )
