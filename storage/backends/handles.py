"""The file handles a backend gives out: each turns the errors of the handle it wraps into
``StorageError``s through its backend, as every other backend operation does (the backend
classes are the only code that touches fsspec, and they translate its errors once).

``WriteHandle`` wraps ``Backend.open_write``'s file, ``TranslatedReader`` a local file opened
for reading, ``RangedReader`` reads an object by ranged requests (``Backend.open_read``).
"""

from __future__ import annotations

import io
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zephon.storage.backends.base import Backend

__all__ = ["OPEN_READ_BLOCK", "RangedReader", "TranslatedReader", "WriteHandle"]

#: bytes per ranged request of a file opened with ``open_read``
OPEN_READ_BLOCK = 8 << 20


class WriteHandle:
    """A file from ``Backend.open_write`` whose writes translate their errors as every
    operation does; everything else is the backend's own handle."""

    def __init__(self, backend: Backend, handle: IO[bytes], path: str) -> None:
        self.raw_handle = handle
        self.path = path
        self._backend = backend

    def write(self, data: Any) -> int:
        with self._backend._doing("writing", self.path, creating=True):
            return self.raw_handle.write(data)

    def flush(self) -> None:
        with self._backend._doing("writing", self.path, creating=True):
            self.raw_handle.flush()

    @property
    def write_in_place(self) -> Any:
        """The handle's ``write_in_place`` (data sent from where it lies, never copied), its
        errors translated; ``AttributeError`` where the handle has none."""
        write = self.raw_handle.write_in_place  # type: ignore[attr-defined]

        def translated(data: Any) -> int:
            with self._backend._doing("writing", self.path, creating=True):
                return write(data)

        return translated

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw_handle, name)


class TranslatedReader:
    """A file open for reading whose reads and seeks translate their errors as every
    operation does (a local file read in place); everything else is the file itself."""

    def __init__(self, backend: Backend, handle: IO[bytes], path: str) -> None:
        self.raw_handle = handle
        self.path = path
        self._backend = backend

    def read(self, size: int = -1) -> bytes:
        with self._backend._doing("reading", self.path):
            return self.raw_handle.read(size)

    def readinto(self, buffer: Any) -> int:
        with self._backend._doing("reading", self.path):
            return self.raw_handle.readinto(buffer)  # type: ignore[attr-defined]

    def seek(self, offset: int, whence: int = 0) -> int:
        with self._backend._doing("reading", self.path):
            return self.raw_handle.seek(offset, whence)

    def __enter__(self) -> TranslatedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.raw_handle.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw_handle, name)


class RangedReader(io.RawIOBase):
    """A file of known size read by ``Backend.read_range``, one (retried) request per read."""

    def __init__(self, backend: Backend, path: str, size: int) -> None:
        self._backend = backend
        self._path = path
        self._size = size
        self._position = 0
        self._opened = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._size, self._position + view.nbytes)
        if end <= self._position:
            if not self._opened:  # an empty file: still an error if it is not there
                self._backend.read_small(self._path)
                self._opened = True
            return 0
        data = self._backend.read_range(self._path, self._position, end)
        self._opened = True
        view[: len(data)] = data
        self._position += len(data)
        return len(data)

    def readall(self) -> bytes:
        # RawIOBase's own reads 8 KiB at a time: here that would be a request each.
        pieces = []
        while piece := self.read(OPEN_READ_BLOCK):
            pieces.append(piece)
        return b"".join(pieces)
