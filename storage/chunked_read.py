"""Reading a deduplicated file: a byte range of it is the matching ranges of its chunks.

``CheckpointReader`` uses these for a file whose manifest entry lists chunks
(``storage/chunks.py``); everything above it (DCP loads, resharding, export, verify) reads by
file name and range as for any other file, and checks the bytes by CRC32C as before.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable, Iterator
from typing import Any

from zephon.storage.chunks import ChunkRef
from zephon.storage.location import Location

__all__ = ["ChunkedReader", "ChunkedStream"]


class ChunkedReader:
    """Ranges of one deduplicated file, read from its chunks. ``FileNotFoundError`` (from
    the backend) names a missing chunk; the caller turns it into damage."""

    def __init__(self, location: Location, chunk_dir: str, chunks: tuple[ChunkRef, ...]):
        self._backend = location.backend
        self._chunk_dir = chunk_dir
        self.chunks = chunks
        self._starts: list[int] = []
        position = 0
        for chunk in chunks:
            self._starts.append(position)
            position += chunk.size
        self.size = position

    def pieces(self, start: int, end: int) -> Iterator[tuple[str, int, int]]:
        """``(chunk path, start, end)`` within each chunk covering ``[start, end)``."""
        end = min(end, self.size)
        if start >= end:
            return
        index = bisect.bisect_right(self._starts, start) - 1
        while index < len(self.chunks) and self._starts[index] < end:
            chunk, base = self.chunks[index], self._starts[index]
            yield (
                f"{self._chunk_dir}/{chunk.name}",
                max(start, base) - base,
                min(end, base + chunk.size) - base,
            )
            index += 1

    def read_range(self, start: int, end: int) -> bytes:
        return b"".join(self._backend.read_range(p, s, e) for p, s, e in self.pieces(start, end))

    def read_range_into(self, start: int, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        for path, s, e in self.pieces(start, start + view.nbytes):
            got = self._backend.read_range_into(path, s, view[done : done + e - s])
            done += got
            if got < e - s:
                break  # a chunk shorter than its reference: the caller sees a short read
        return done

    def read_range_stream(self, start: int, end: int, sink: Callable[[memoryview], None]) -> int:
        done = 0
        for path, s, e in self.pieces(start, end):
            got = self._backend.read_range_stream(path, s, e, sink)
            done += got
            if got < e - s:
                break
        return done

    def read_all(self) -> bytes:
        buffer = bytearray(self.size)
        got = self.read_range_into(0, buffer)
        return bytes(buffer[:got])


class ChunkedStream(io.RawIOBase):
    """A deduplicated file as a readable stream, in ranged reads of its chunks."""

    def __init__(self, reader: ChunkedReader) -> None:
        self._reader = reader
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._reader.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        got = self._reader.read_range_into(self._position, view)
        self._position += got
        return got
