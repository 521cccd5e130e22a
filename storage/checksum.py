"""CRC32C, the checksum S3 and GCS compute natively, kept as a running value while writing.

Checksums are stored as base64 of the big-endian 32-bit value, the form both object stores use
in their APIs (``x-amz-checksum-crc32c``, GCS ``crc32c``), so a manifest can be compared with
what the store reports without recomputing.
"""

from __future__ import annotations

import base64

import google_crc32c

__all__ = ["Crc32c", "crc32c_of", "encode_crc32c"]

# google_crc32c only takes bytes and holds the GIL, so large buffers are fed in slices: each
# slice is copied once, which keeps peak memory bounded for memoryviews of big tensors.
_SLICE = 8 << 20


def encode_crc32c(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


class Crc32c:
    """A running CRC32C and byte count over data fed in order."""

    __slots__ = ("value", "size")

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if isinstance(data, bytes):
            self.value = google_crc32c.extend(self.value, data)
            self.size += len(data)
            return
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _SLICE):
            piece = bytes(view[start : start + _SLICE])
            self.value = google_crc32c.extend(self.value, piece)
        self.size += len(view)

    def encoded(self) -> str:
        return encode_crc32c(self.value)


def crc32c_of(data: bytes | bytearray | memoryview) -> str:
    """The encoded CRC32C of one buffer."""
    running = Crc32c()
    running.update(data)
    return running.encoded()
