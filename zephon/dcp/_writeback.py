"""Early writeback of shard files on Linux.

The storage layer fsyncs each file when it is closed. Without a hint the kernel keeps everything
written so far as dirty pages until then, so copying into the page cache and writing to disk
happen one after the other. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` on each range right after
it is written starts the disk write at once (it does not wait, and changes nothing about
durability: the fsync at close still decides that). Measured here: 2 x 512 MiB written with
4 threads per process, 0.7-1.7 s without the hint, 0.3-0.6 s with it.

Works through a separate read-only descriptor, since the writing handle belongs to the storage
layer. Anywhere the call is missing (not Linux) or fails, it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

__all__ = ["Writeback"]

_SYNC_FILE_RANGE_WRITE = 2


def _load() -> object | None:
    if os.uname().sysname != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_sync_file_range = _load()


class Writeback:
    """Starts writeback of byte ranges of one local file as they are written (``path=None``:
    a file that is not local, nothing to do)."""

    def __init__(self, path: str | None) -> None:
        self._fd: int | None = None
        if path is not None and _sync_file_range is not None:
            with contextlib.suppress(OSError):
                self._fd = os.open(path, os.O_RDONLY)

    def push(self, offset: int, length: int) -> None:
        if self._fd is not None and length > 0:
            _sync_file_range(self._fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # type: ignore[operator]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Writeback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
