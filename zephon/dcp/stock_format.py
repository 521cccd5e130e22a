"""torch's own DCP file format, written next to Zephon's so stock DCP readers load a checkpoint.

torch's ``FileSystemReader`` and ``FsspecReader`` read a tensor item with
``torch.load(bytes, weights_only=True)`` from the ``_StorageInfo(relative_path, offset, length)``
that the pickled ``.metadata`` names. So the writer stores each tensor as a ``torch.save`` blob;
``torch.save``'s zip archive keeps the tensor's storage bytes uncompressed and 64-byte aligned,
so Zephon's JSON slice points at those raw bytes inside the blob (its reader and range fetches
are unchanged, older saves stay readable) while the stock ``.metadata`` points at the whole blob.

``ShardStream`` writes a shard file's items, each tensor as its blob, without copying a tensor
(the zip's small headers and small items are gathered into few writes; a tensor's bytes go out
as a view of it).
``raw_span`` finds the storage bytes in a blob from the zip's central directory and the record's
local header: nothing is ever unpickled. ``stock_metadata`` is the pickled ``.metadata`` a stock
reader opens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from zephon.errors import UsageError
from zephon.locations import stock_dcp_url
from zephon.storage import CheckpointReader, crc32c_extend

__all__ = [
    "STOCK_METADATA_FILE",
    "Blob",
    "ShardStream",
    "own_storage",
    "raw_span",
    "stock_directory",
    "stock_metadata",
]

#: the file torch's ``FileSystemReader``/``FsspecReader`` open first, in the payload directory
STOCK_METADATA_FILE = ".metadata"
#: a write this large (a tensor's bytes) goes out as it is; smaller ones are gathered
_DIRECT_BYTES = 64 * 1024
#: gathered bytes are written once they reach this size
_GATHER_BYTES = 1024 * 1024
#: (dtype, shape, alignment) -> the bytes of a small tensor's blob before and after its elements
_TEMPLATES: dict[tuple[torch.dtype, tuple[int, ...], int], tuple[bytes, bytes]] = {}
_MAX_TEMPLATES = 4096

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


def stock_directory(checkpoint: CheckpointReader) -> str:
    """The URL of the directory to point torch's stock ``FileSystemReader``/``FsspecReader``
    at for a committed checkpoint (``store.run(run).reader(step)``): the directory holding its
    ``.metadata``. The same as ``stock_dcp_url`` in ``zephon latest/checkpoints --json``."""
    manifest = checkpoint.manifest
    url = stock_dcp_url(checkpoint.url, manifest.payload, manifest.metadata)
    if url is None:
        raise UsageError(
            f"checkpoint {checkpoint.url} has no torch .metadata (not a DCP save, or saved "
            "before Zephon wrote one): load it with zephon.dcp.Reader instead"
        )
    return url


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
    # torch writes no zip comment, so the record is the last 22 bytes; else search for it
    tail_len = min(size, 22)
    tail = read(size - tail_len, tail_len)
    if tail[:4] != _EOCD:
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


@dataclass(frozen=True)
class Blob:
    """Where one tensor's ``torch.save`` blob went in its shard file: ``length`` bytes from
    ``start``; the tensor's raw bytes (C order) at ``raw_offset`` within it, ``raw_length``
    long, with CRC32C ``raw_crc32c``."""

    start: int
    length: int
    raw_offset: int
    raw_length: int
    raw_crc32c: int


def _storage_alignment() -> int:
    """The alignment ``torch.save`` gives storage records (64 unless configured)."""
    aligned = getattr(torch.serialization, "_get_storage_alignment", None)
    return aligned() if aligned is not None else 64


def _save_without_crc32(tensor: torch.Tensor, out: Any, alignment: int) -> None:
    """``torch.save(tensor, out)`` with ``compute_crc32=False`` for this blob only (the public
    switch, ``torch.utils.serialization.config``, is process-wide, so it would change other
    threads' saves too). Both calls are torch internals (checked with torch 2.13): a torch
    without them gets the public ``torch.save``, which only adds a pass for the zip's CRC32."""
    try:
        archive = torch._C.PyTorchFileWriter(out, False, alignment)
        save = torch.serialization._save
    except (AttributeError, TypeError):
        torch.save(tensor, out)
        return
    try:
        save(tensor, archive, pickle, 2, False)
    except BaseException:
        # finish the archive now, whatever it raises: an archive left unfinished is finished by
        # its C++ destructor at garbage collection, and a write failing there (the storage
        # that failed this save) ends the whole process (std::terminate, "Aborted")
        with contextlib.suppress(Exception):
            archive.write_end_of_file()
        raise
    archive.write_end_of_file()


class ShardStream:
    """One shard file's items, written in order through ``emit(view) -> CRC32C of view``.

    Every view emitted stays alive and unchanged for as long as the caller holds it, so the
    caller may send it from where it lies after ``emit`` returns (the native data path queues
    it, ``RecordingFile.write(in_place=True)``): a tensor's bytes go out as a view of the
    tensor's own memory (which the view keeps alive), never copied; small writes (a blob's
    zip headers, small tensors, small bytes items) are gathered into a fresh buffer of up to
    ``_GATHER_BYTES`` per ``emit``, never reused, so a file of many small items costs few
    writes. A large bytes item is copied once (its ``BytesIO`` is the planner's). ``close()``
    writes what is still gathered.
    """

    def __init__(self, emit: Callable[[memoryview], int]) -> None:
        self._emit = emit
        self.position = 0
        self._pending = bytearray()
        # the blob being written: its start, its small runs (for ``locate_storage``: kept
        # as (offset in the blob, bytes)) and its large writes (offset, length, CRC32C)
        self._blob_start = 0
        self._runs: list[tuple[int, bytearray]] = []
        self._direct: list[tuple[int, int, int]] = []
        # the tensor being saved: its bytes as a view that keeps it alive, and their address
        self._tensor_bytes: memoryview | None = None
        self._tensor_address = 0

    def add_bytes(self, data: memoryview) -> tuple[int, int]:
        """Write a bytes item; returns its offset in the file and its CRC32C."""
        start = self.position
        if data.nbytes >= _DIRECT_BYTES:
            self._drain()
            crc = self._emit(memoryview(bytes(data)))
        else:
            crc = crc32c_extend(0, data)
            self._gather(data)
        self.position += data.nbytes
        return start, crc

    def add_tensor(self, tensor: torch.Tensor) -> Blob:
        """Write ``tensor`` (dense, on the CPU, contiguous, owning exactly its storage, as
        ``own_storage`` makes it) as a ``torch.save`` blob.

        The zip's own CRC32 is not computed (``torch.load`` does not check it, and it would cost
        a pass over every byte at about 1.5 GB/s); Zephon's CRC32C covers the bytes instead.
        """
        alignment = _storage_alignment()
        nbytes = tensor.numel() * tensor.element_size()
        key = (tensor.dtype, tuple(tensor.shape), alignment)
        template = _TEMPLATES.get(key) if nbytes < _DIRECT_BYTES else None
        if template is not None:
            return self._from_template(tensor, *template)
        self._blob_start, self._runs, self._direct = self.position, [], []
        self._tensor_bytes = _bytes_of(tensor)
        self._tensor_address = tensor.data_ptr()
        try:
            _save_without_crc32(tensor, self, alignment)
        finally:
            self._tensor_bytes = None
        length = self.position - self._blob_start
        offset, raw_length = locate_storage(self._read, length)
        if raw_length != tensor.numel() * tensor.element_size():
            raise ValueError(
                f"torch.save wrote {raw_length} storage bytes for a tensor of {tensor.nbytes}: "
                "save a tensor that owns its storage exactly"
            )
        crc = self._crc_of(offset, raw_length, tensor)
        if nbytes < _DIRECT_BYTES and len(self._runs) == 1:
            if len(_TEMPLATES) >= _MAX_TEMPLATES:
                _TEMPLATES.clear()
            blob = self._runs[0][1]
            _TEMPLATES[key] = (bytes(blob[:offset]), bytes(blob[offset + raw_length :]))
        return Blob(self._blob_start, length, offset, raw_length, crc)

    def _from_template(self, tensor: torch.Tensor, head: bytes, tail: bytes) -> Blob:
        """A small tensor's blob from the zip around an earlier one of the same dtype and shape
        (all that its headers, pickle and central directory depend on: the tensor is dense,
        contiguous, detached and owns its storage): ``torch.save`` costs ~100 us a tensor,
        which a state of many small tensors would pay on every save."""
        raw = _bytes_of(tensor)
        start = self.position
        crc = crc32c_extend(0, raw)
        for piece in (memoryview(head), raw, memoryview(tail)):
            self._gather(piece)
        self.position += len(head) + raw.nbytes + len(tail)
        return Blob(start, self.position - start, len(head), raw.nbytes, crc)

    def close(self) -> None:
        self._drain()

    # -- the file-like object torch.save writes a blob into -------------------------------

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        size = view.nbytes
        at = self.position - self._blob_start
        if size >= _DIRECT_BYTES:
            self._drain()
            self._direct.append((at, size, self._emit(self._lasting(view))))
        else:
            self._gather(view)
            if self._runs and self._runs[-1][0] + len(self._runs[-1][1]) == at:
                self._runs[-1][1].extend(view)
            else:
                self._runs.append((at, bytearray(view)))
        self.position += size
        return size

    def flush(self) -> None:
        """Called by ``torch.save`` at the end of a blob: gathered bytes wait for more."""

    # -- internals ------------------------------------------------------------------------

    def _lasting(self, view: memoryview) -> memoryview:
        """``view`` (which ``torch.save`` lends only for the call) as a view that stays valid:
        the same bytes of the tensor being saved, where they lie in it (no copy); a copy of
        anything else."""
        whole = self._tensor_bytes
        if whole is not None:
            offset = _address(view) - self._tensor_address
            if offset >= 0 and offset + view.nbytes <= whole.nbytes:
                return whole[offset : offset + view.nbytes]
        return memoryview(bytes(view))

    def _gather(self, view: memoryview) -> None:
        self._pending += view
        if len(self._pending) >= _GATHER_BYTES:
            self._drain()

    def _drain(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self._emit(memoryview(pending))

    def _read(self, offset: int, length: int) -> bytes:
        for start, kept in self._runs:
            if start <= offset and offset + length <= start + len(kept):
                return bytes(kept[offset - start : offset - start + length])
        raise ValueError(f"not a torch.save blob: no zip record at {offset}+{length}")

    def _crc_of(self, offset: int, length: int, tensor: torch.Tensor) -> int:
        """The CRC32C of the blob's bytes at ``offset``, which hold ``tensor``'s storage."""
        for start, size, crc in self._direct:
            if (start, size) == (offset, length):
                return crc
        for start, kept in self._runs:
            if start <= offset and offset + length <= start + len(kept):
                return crc32c_extend(0, memoryview(kept)[offset - start : offset - start + length])
        # torch.save split the storage into several writes: checksum the tensor's bytes again
        return crc32c_extend(0, _bytes_of(tensor))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A dense CPU tensor's bytes as a flat view that keeps the tensor's memory alive."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _address(view: memoryview) -> int:
    """The address of a buffer's first byte."""
    import numpy

    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself if it is contiguous and owns exactly its storage; for a contiguous view
    into a larger storage (a slice, a flat parameter's shard) a tensor over the same memory
    whose storage is exactly its elements (``torch.save`` writes a view's whole storage); a
    contiguous copy otherwise."""
    if not tensor.is_contiguous():
        return tensor.contiguous()
    if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    if tensor.numel() == 0:
        return tensor.clone()
    elements = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    return torch.frombuffer(elements, dtype=tensor.dtype).view(tensor.shape)


def stock_metadata(metadata: Metadata, storage: Mapping[MetadataIndex, _StorageInfo]) -> bytes:
    """torch's own ``.metadata`` for ``metadata``: the same object with ``storage`` (each item's
    file relative to the payload directory, and the span of its blob or bytes) as its
    ``storage_data``, pickled as torch's ``FileSystemWriter`` does."""
    return pickle.dumps(dataclasses.replace(metadata, storage_data=dict(storage)))
