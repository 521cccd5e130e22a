"""A payload file being written: its size and CRC32C recorded as the bytes go out.

``CheckpointWriter`` opens one per file it writes through the backend; what it records becomes
the file's manifest entry, never computed by reading the file back.
"""

from __future__ import annotations

import io
from typing import IO, TYPE_CHECKING

from zephon.storage.checksum import Crc32c
from zephon.storage.writeback import WRITEBACK_EVERY, start_writeback

if TYPE_CHECKING:
    from zephon.storage.backends import Backend

__all__ = ["ChecksummedReader", "RecordingFile"]


class RecordingFile:
    """A write-only file that records the size and CRC32C of every byte on its way out; on
    local disk it also starts the writeback of what it wrote every few MiB, so the fsync at the
    end finds little left to do."""

    def __init__(self, handle: IO[bytes], backend: Backend, part_size: int = 0) -> None:
        self._handle = handle
        self._backend = backend
        self._local = backend.posix_paths  # an OS file: writeback can be started on it
        self._part_size = part_size
        self.crc = Crc32c()
        self._written = 0
        self._flushed_to = 0

    def write(
        self,
        data: bytes | bytearray | memoryview,
        crc: int | None = None,
        *,
        in_place: bool = False,
    ) -> int:
        """Write ``data`` (any C-contiguous buffer, e.g. a whole tensor's byte view, in one
        call) and add it to the file's size and CRC32C; returns its length in bytes.

        ``crc``, if given, must be the CRC32C of exactly ``data`` (e.g. from
        ``storage.checksum.crc32c_extend(0, data)``, computed once by a caller that records it
        anyway): it is combined into the file's CRC instead of reading the bytes a second time.
        It is trusted, not checked: a wrong value makes the manifest disagree with the file.

        On local disk the bytes go out in ``WRITEBACK_EVERY`` pieces and each piece's writeback
        starts as soon as it is written, so copying into the page cache and writing to disk
        overlap; without ``crc`` each piece is checksummed right before it is copied.

        On object stores the upload buffer is filled only up to one part at a time
        (``_write_parts``), so a file being written holds at most about two parts in memory
        (the buffer and the part's request body), however large ``data`` is.

        ``in_place=True`` promises that ``data`` stays alive and unchanged until the file is
        finished or discarded (a tensor's memory during a save): a backend that can send it
        from where it lies (the native data path, ``write_in_place``) does, never copying it;
        the others write it as usual.
        """
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        size = view.nbytes
        if not self._local:
            if crc is None:
                self.crc.update(view)
            else:
                self.crc.extend(crc, size)
            in_place_write = getattr(self._handle, "write_in_place", None) if in_place else None
            if in_place_write is not None:
                in_place_write(view)
            else:
                self._write_parts(view)
            return size
        for start in range(0, size, WRITEBACK_EVERY):
            piece = view[start : start + WRITEBACK_EVERY]
            if crc is None:
                self.crc.update(piece)
            self._handle.write(piece)
            self._written += piece.nbytes
            if self._written - self._flushed_to >= WRITEBACK_EVERY:
                self._handle.flush()
                start_writeback(
                    self._handle.fileno(), self._flushed_to, self._written - self._flushed_to
                )
                self._flushed_to = self._written
        if crc is not None:
            self.crc.extend(crc, size)
        return size

    def _write_parts(self, view: memoryview) -> None:
        # fsspec's buffered files copy everything written into an in-memory buffer and upload
        # it once it reaches the block size; s3fs then sends the whole buffer as one part. A
        # 1 GiB tensor written in one call would be buffered whole, then copied again into its
        # part. Topping the buffer up to exactly one part per call keeps both at one part.
        part, start, size = self._part_size, 0, view.nbytes
        if not part:
            self._handle.write(view)
            return
        while start < size:
            buffer = getattr(self._handle, "buffer", None)
            held = buffer.tell() if isinstance(buffer, io.BytesIO) else 0
            room = part - held if held < part else part
            self._handle.write(view[start : start + room])
            start += room

    def finish(self) -> None:
        self._backend.finish_write(self._handle)

    def discard(self) -> None:
        self._backend.discard_write(self._handle)


class ChecksummedReader(io.RawIOBase):
    """A readable stream that records the size and CRC32C of every byte read through it (a
    file read back once, e.g. a server-side copy, whose entry is what was read)."""

    def __init__(self, handle: IO[bytes]) -> None:
        super().__init__()
        self._handle = handle
        self.crc = Crc32c()

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self.crc.update(data)
        return data

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
