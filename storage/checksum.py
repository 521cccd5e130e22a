"""CRC32C, the checksum S3 and GCS compute natively, kept as a running value while writing.

Checksums are stored as base64 of the big-endian 32-bit value, the form both object stores use
in their APIs (``x-amz-checksum-crc32c``, GCS ``crc32c``), so a manifest can be compared with
what the store reports without recomputing.

The bytes go through the ``crc32c`` package (ICRAR's; LGPL-2.1-or-later, used as a separate
library): the CPU's CRC32C instruction (SSE 4.2 on x86-64, the CRC extension on ARMv8) over
three interleaved streams, reading any C-contiguous buffer in place (read-only ones included),
with the GIL released from 32 KiB on, so files written or read on several threads are
checksummed in parallel. Every byte a save writes or a load reads passes through it once, so
its speed is a share of every save's and load's CPU: on this project's test machines it ran at
19 GiB/s on a 64 MiB buffer and 27-29 GiB/s in cache, against 5.4 and 13-19 GiB/s for
google-crc32c's library, which Zephon used before (docs/dcp.md, "Benchmark").

``crc32c_combine`` gives the CRC of a concatenation from the CRCs of its parts, so a block
whose CRC is already known (e.g. a tensor checksummed once for its own record) can be appended
to a running file CRC without reading its bytes again (``Crc32c.extend``).
"""

from __future__ import annotations

import base64
import binascii
import functools

import crc32c as _crc32c

from zephon.storage.errors import InvalidArgumentError

__all__ = [
    "NATIVE",
    "Crc32c",
    "crc32c_combine",
    "crc32c_extend",
    "crc32c_of",
    "decode_crc32c",
    "encode_crc32c",
]

#: whether the CPU's CRC32C instruction is in use (else the package's table-driven software
#: code, several times slower, which it also warns about when imported)
NATIVE: bool = bool(_crc32c.hardware_based)


def crc32c_extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    """The CRC32C of (the data ``crc`` was computed over) followed by ``data``; ``crc=0``
    starts a new one. ``data`` must be C-contiguous (else ``BufferError``); it is never
    copied."""
    return _crc32c.crc32c(data, crc)


# -- combining ------------------------------------------------------------------------------------
#
# CRC32C is a polynomial remainder over GF(2), kept bit-reflected: bit 31 of a value is the
# coefficient of x^0. Appending n zero bits to a message multiplies its remainder by x^n mod P,
# and the pre- and post-inversion of the standard CRC cancel out between the two parts, so
#     crc(A || B) = crc(A) * x^(8 * len(B)) mod P  xor  crc(B)
# (the same derivation as zlib's crc32_combine). x^n is built from the powers x^(2^k), which
# are computed once; a combine then costs one multiplication per set bit of 8 * len(B).

_POLY = 0x82F63B78  # Castagnoli's polynomial, reflected
_X0 = 1 << 31  # the polynomial 1 (x^0), reflected


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) mod P, both reflected."""
    product = 0
    bit = _X0
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers_of_x() -> tuple[int, ...]:
    # x^(2^k) for k = 0..66 covers 8 * length for any length below 2^64. P is not irreducible
    # (it has the factor x + 1), so the powers do not cycle with period 32 as zlib's table does
    # for CRC-32: every one is computed.
    power = _X0 >> 1  # x^1
    table = [power]
    for _ in range(66):
        power = _multmodp(power, power)
        table.append(power)
    return tuple(table)


_X_POW_2K = _powers_of_x()


@functools.lru_cache(maxsize=1024)
def _shift_for(length: int) -> int:
    """x^(8 * length) mod P: the factor that moves a CRC past ``length`` zero bytes. Cached
    because a checkpoint repeats the same few tensor sizes many times."""
    result = _X0
    bits = 8 * length
    k = 0
    while bits:
        if bits & 1:
            result = _multmodp(_X_POW_2K[k], result)
        bits >>= 1
        k += 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of A || B, from the CRC32C of A, that of B, and B's length in bytes.

    Costs O(log len_b) operations on 32-bit values, whatever the sizes: used to append a block
    whose CRC is already known without reading it again.
    """
    if len_b < 0:
        raise InvalidArgumentError(f"crc32c_combine: len_b must be >= 0, got {len_b}")
    if not 0 <= crc_a <= 0xFFFFFFFF or not 0 <= crc_b <= 0xFFFFFFFF:
        raise InvalidArgumentError(
            f"crc32c_combine: CRC values must be 32-bit unsigned, got {crc_a:#x} and {crc_b:#x}"
        )
    if len_b == 0:
        return crc_a
    return _multmodp(_shift_for(len_b), crc_a) ^ crc_b


# -- encoding -------------------------------------------------------------------------------------


def encode_crc32c(value: int) -> str:
    """``value`` as stored: base64 of its 4 big-endian bytes (8 characters)."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def decode_crc32c(text: str) -> int:
    """The value ``encode_crc32c`` encoded; ``InvalidArgumentError`` (a ``ValueError``) for
    anything that is not exactly such an 8-character base64 string."""
    if not isinstance(text, str) or len(text) != 8:
        raise InvalidArgumentError(f"a CRC32C is 8 base64 characters, got {str(text)[:40]!r}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise InvalidArgumentError(f"a CRC32C is 8 base64 characters, got {text!r}") from None
    value = int.from_bytes(raw, "big")
    if len(raw) != 4 or encode_crc32c(value) != text:
        raise InvalidArgumentError(f"{text!r} is not the base64 of a 4-byte CRC32C")
    return value


def is_encoded_crc32c(text: object) -> bool:
    """Whether ``text`` is a CRC32C in its encoded form (base64 of 4 bytes), as manifests and
    chunk references record it."""
    if not isinstance(text, str) or len(text) != 8:
        return False
    try:
        return len(base64.b64decode(text, validate=True)) == 4
    except binascii.Error:
        return False


class Crc32c:
    """A running CRC32C and byte count over data fed in order."""

    __slots__ = ("value", "size")

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed ``data`` (C-contiguous) through the checksum."""
        self.value = _crc32c.crc32c(data, self.value)
        self.size += memoryview(data).nbytes

    def extend(self, crc: int, length: int) -> None:
        """Append a block of ``length`` bytes whose CRC32C ``crc`` the caller already knows,
        without its bytes (``crc32c_combine``). A wrong ``crc`` goes into the total unnoticed:
        pass only a CRC computed over exactly the bytes written."""
        self.value = crc32c_combine(self.value, crc, length)
        self.size += length

    def encoded(self) -> str:
        return encode_crc32c(self.value)


def crc32c_of(data: bytes | bytearray | memoryview) -> str:
    """The encoded CRC32C of one buffer."""
    running = Crc32c()
    running.update(data)
    return running.encoded()
