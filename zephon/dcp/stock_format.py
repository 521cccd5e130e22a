"""torch's own DCP file format, written next to Zephon's so stock DCP readers load a checkpoint.

torch's ``FileSystemReader`` and ``FsspecReader`` read a tensor item with
``torch.load(bytes, weights_only=True)`` from the ``_StorageInfo(relative_path, offset, length)``
that the pickled ``.metadata`` names. So the writer stores each tensor as a ``torch.save`` blob;
``torch.save``'s zip archive keeps the tensor's storage bytes uncompressed and 64-byte aligned,
so Zephon's JSON slice points at those raw bytes inside the blob (its reader and range fetches
are unchanged, older saves stay readable) while the stock ``.metadata`` points at the whole blob.

``raw_span`` finds the storage bytes in a blob from the zip's central directory and the record's
local header: nothing is ever unpickled.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

__all__ = ["raw_span"]

_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_CENTRAL_HEADER = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL_HEADER_SIZE = 30
_MAX32 = 0xFFFFFFFF
_MAX16 = 0xFFFF
#: ``<archive>/data/<key>``: where ``torch.save`` puts a storage's bytes
_STORAGE_RECORD = re.compile(r"[^/]+/data/[0-9]+")

Read = Callable[[int, int], bytes]


def raw_span(blob: bytes | memoryview) -> tuple[int, int]:
    """``(offset, length)`` of the tensor storage's bytes inside a ``torch.save`` blob of one
    tensor (found through the zip's central directory and the record's local header, never by
    unpickling). Raises ``ValueError`` naming what is wrong if ``blob`` is not such a blob."""
    view = memoryview(blob).cast("B")

    def read(offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > view.nbytes:
            raise ValueError(
                f"not a torch.save blob: a zip record at {offset}+{length} lies beyond its "
                f"{view.nbytes} bytes"
            )
        return bytes(view[offset : offset + length])

    return locate_storage(read, view.nbytes)


def locate_storage(read: Read, size: int) -> tuple[int, int]:
    """``raw_span`` over ``read(offset, length)`` of a blob of ``size`` bytes (the writer reads
    only the pieces of a blob it kept: its zip headers, never the tensor bytes)."""
    cd_offset, cd_size = _central_directory(read, size)
    directory = read(cd_offset, cd_size)
    found: list[tuple[str, int, int]] = []
    position = 0
    while position + _CENTRAL_HEADER.size <= len(directory):
        fields = _CENTRAL_HEADER.unpack_from(directory, position)
        if fields[0] != _CENTRAL:
            break
        method, csize, usize = fields[4], fields[8], fields[9]
        name_len, extra_len, comment_len, local = fields[10], fields[11], fields[12], fields[16]
        start = position + _CENTRAL_HEADER.size
        name = directory[start : start + name_len].decode("utf-8", "replace")
        extra = directory[start + name_len : start + name_len + extra_len]
        usize, csize, local = _zip64_sizes(extra, usize, csize, local)
        if _STORAGE_RECORD.fullmatch(name):
            if method != 0 or csize != usize:
                raise ValueError(f"not a torch.save blob: its record {name!r} is compressed")
            found.append((name, local, csize))
        position = start + name_len + extra_len + comment_len
    if len(found) != 1:
        raise ValueError(
            f"not a torch.save blob of one tensor: it holds {len(found)} storage records "
            "(save a tensor that owns its storage exactly: clone a view first)"
        )
    name, local, length = found[0]
    header = read(local, _LOCAL_HEADER_SIZE)
    if header[:4] != _LOCAL:
        raise ValueError(f"not a torch.save blob: no local header for {name!r} at {local}")
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    offset = local + _LOCAL_HEADER_SIZE + name_len + extra_len
    if offset + length > size:
        raise ValueError(f"not a torch.save blob: {name!r} runs past the blob's {size} bytes")
    return offset, length


def _central_directory(read: Read, size: int) -> tuple[int, int]:
    """The central directory's offset and size, from the end-of-central-directory record (or its
    zip64 form, which ``torch.save`` always writes)."""
    tail_len = min(size, 22 + _MAX16)
    tail = read(size - tail_len, tail_len)
    at = tail.rfind(_EOCD)
    if at < 0:
        raise ValueError("not a torch.save blob: no zip end-of-central-directory record")
    eocd = size - tail_len + at
    cd_size, cd_offset = struct.unpack_from("<II", tail, at + 12)
    if eocd >= 20:
        locator = read(eocd - 20, 20)
        if locator[:4] == _ZIP64_LOCATOR:
            (zip64_at,) = struct.unpack_from("<Q", locator, 8)
            record = read(zip64_at, 56)
            if record[:4] != _ZIP64_EOCD:
                raise ValueError("not a torch.save blob: its zip64 end record is missing")
            cd_size, cd_offset = struct.unpack_from("<QQ", record, 40)
    return cd_offset, cd_size


def _zip64_sizes(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    """Sizes and local-header offset, taken from the zip64 extra field where the 32-bit ones are
    saturated (the field holds only those, in this order)."""
    position = 0
    while position + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4 : position + 4 + length]
        if tag == 1:
            values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            wanted = [usize == _MAX32, csize == _MAX32, local == _MAX32]
            out = [usize, csize, local]
            for i in range(3):
                if wanted[i] and values:
                    out[i] = values.pop(0)
            return out[0], out[1], out[2]
        position += 4 + length
    return usize, csize, local
