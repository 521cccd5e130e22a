"""CRC32C, the checksum S3 and GCS compute natively, kept as a running value while writing.

Checksums are stored as base64 of the big-endian 32-bit value, the form both object stores use
in their APIs (``x-amz-checksum-crc32c``, GCS ``crc32c``), so a manifest can be compared with
what the store reports without recomputing.

google-crc32c's Python API takes only ``bytes`` and holds the GIL. Where its wheel ships the C
library (``libcrc32c``), it is called through ctypes instead: no copy of the caller's buffer, and
the GIL is released, so files written on several threads are checksummed in parallel.
"""

from __future__ import annotations

import base64
import ctypes
import glob
import os

import google_crc32c

__all__ = ["Crc32c", "crc32c_of", "encode_crc32c", "NATIVE"]

# Fallback path: each slice is copied once into bytes, which bounds peak memory for views of
# large tensors.
_SLICE = 8 << 20


def _load_native() -> ctypes.CDLL | None:
    package = os.path.dirname(os.path.dirname(google_crc32c.__file__))
    for path in sorted(glob.glob(os.path.join(package, "google_crc32c.libs", "libcrc32c*"))):
        try:
            lib = ctypes.CDLL(path)
            extend = lib.crc32c_extend
        except (OSError, AttributeError):
            continue
        extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        extend.restype = ctypes.c_uint32
        if extend(0, b"hello", 5) == google_crc32c.extend(0, b"hello"):
            return lib
    return None


_NATIVE = _load_native()
#: whether the GIL-free, copy-free path is in use
NATIVE = _NATIVE is not None


def _extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    if _NATIVE is not None:
        if isinstance(data, bytes):
            return _NATIVE.crc32c_extend(crc, data, len(data))
        view = memoryview(data).cast("B")
        if view.readonly:
            return _extend_copying(crc, view)
        if not view.nbytes:
            return crc
        pointer = (ctypes.c_char * view.nbytes).from_buffer(view)
        return _NATIVE.crc32c_extend(crc, pointer, view.nbytes)
    if isinstance(data, bytes):
        return google_crc32c.extend(crc, data)
    return _extend_copying(crc, memoryview(data).cast("B"))


def _extend_copying(crc: int, view: memoryview) -> int:
    for start in range(0, len(view), _SLICE):
        crc = google_crc32c.extend(crc, bytes(view[start : start + _SLICE]))
    return crc


def encode_crc32c(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


class Crc32c:
    """A running CRC32C and byte count over data fed in order."""

    __slots__ = ("value", "size")

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.value = _extend(self.value, data)
        self.size += memoryview(data).nbytes

    def encoded(self) -> str:
        return encode_crc32c(self.value)


def crc32c_of(data: bytes | bytearray | memoryview) -> str:
    """The encoded CRC32C of one buffer."""
    running = Crc32c()
    running.update(data)
    return running.encoded()
