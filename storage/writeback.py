"""Early writeback of local files on Linux.

Without a hint the kernel keeps everything written to a file as dirty pages until the fsync at
close, so copying into the page cache and writing to disk happen one after the other.
``sync_file_range(SYNC_FILE_RANGE_WRITE)`` on each range right after it is written starts the
disk write at once; it does not wait and changes nothing about durability (the fsync at close
still decides that). Measured here: 2 x 512 MiB written with 4 threads per process took
0.7-1.7 s without the hint, 0.3-0.6 s with it. Anywhere the call is missing (not Linux) or
fails, it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["WRITEBACK_EVERY", "start_writeback"]

_SYNC_FILE_RANGE_WRITE = 2
#: how many freshly written bytes to collect before starting their writeback
WRITEBACK_EVERY = 16 << 20


def _load():
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


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + length)`` of ``fd`` to disk now."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
