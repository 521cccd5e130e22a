"""Reading a stock DCP checkpoint without running anything from it (``zephon adopt``).

A checkpoint written by torch's own ``FileSystemWriter`` or ``FsspecWriter`` is a directory
with a pickled ``.metadata`` and ``__<rank>_<n>.distcp`` files. ``storage_data`` maps each
``MetadataIndex`` to a ``_StorageInfo`` (file, offset, length); at that place a tensor item is
a ``torch.save`` blob (a zip archive whose ``data.pkl`` rebuilds the tensor from the storage
bytes kept uncompressed in ``data/<key>``) and a non-tensor item is the bytes DCP's planner
wrote (itself a ``torch.save`` pickle, which Zephon's reader rebuilds with its restricted
unpickler on every load).

Both pickles here are untrusted input: they are read by ``zephon.dcp.untrusted``'s allowlist
unpickler, which looks up only the globals named below (torch DCP's metadata classes,
``torch.Size``, dtypes, layouts, memory formats, ``OrderedDict``; in a blob's ``data.pkl``
the tensor rebuild functions, answered by a placeholder that records their arguments, and
storage classes). Nothing is rebuilt as a tensor: ``tensor_span`` only says where a blob's
tensor bytes are (the storage record from ``zephon.dcp.stock_format.raw_span``, the tensor's
offset, shape and strides in it from ``data.pkl``), so that Zephon's JSON metadata can point
at them. Anything else (a global
outside the lists, a compressed zip entry, a transform such as compression, a view that is not
contiguous, a dtype or shape other than the metadata's, a truncated blob) raises
``StockCheckpointError`` naming the file and the fix.
"""

from __future__ import annotations

import collections
import io
import pathlib
import sys
import zipfile
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from zephon.dcp.errors import StockCheckpointError
from zephon.dcp.stock_format import raw_span
from zephon.dcp.untrusted import UnpickleRefused, unpickle_allowed
from zephon.dtypes import DTYPES
from zephon.storage import InvalidNameError, validate_file_name

__all__ = ["StockCheckpoint", "StockItem", "read_stock_metadata", "tensor_span"]

_FIX = "adopt only checkpoints written by torch.distributed.checkpoint's FileSystemWriter"
_LAYOUTS = {str(torch.strided): torch.strided, str(torch.sparse_coo): torch.sparse_coo}
_DTYPE_GLOBALS = {("torch", name): dtype for name, dtype in DTYPES.items()}


def _path(*parts: str) -> str:
    """A pickled ``pathlib`` path (``StorageMeta.checkpoint_id``), kept as a string."""
    return str(pathlib.PurePosixPath(*parts))


_PATHS = {("pathlib", n): _path for n in ("Path", "PosixPath", "PurePosixPath")}
#: the metadata classes whose instances a ``.metadata`` pickle builds and fills in
_BUILDABLE = (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    _StorageInfo,
)
_METADATA_CLASSES = (*_BUILDABLE[:-1], _MEM_FORMAT_ENCODING)


def _layout(name: Any) -> torch.layout:
    """What a pickled ``torch.serialization._get_layout(name)`` means, from a fixed table."""
    if name not in _LAYOUTS:
        raise UnpickleRefused(f"it names the layout {str(name)[:40]!r}")
    return _LAYOUTS[name]


#: every global a stock ``.metadata`` may name, and what it is answered with
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", c.__name__): c for c in _METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **_PATHS,  # StorageMeta.checkpoint_id: kept as a string
    **_DTYPE_GLOBALS,
}


@dataclass(frozen=True)
class StockItem:
    """One item of a stock checkpoint: ``length`` bytes at ``offset`` of ``file``; for a
    tensor item its chunk's ``dtype`` and ``shape`` (from the metadata)."""

    index: MetadataIndex
    file: str
    offset: int
    length: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


@dataclass(frozen=True)
class StockCheckpoint:
    """A stock checkpoint's metadata, read: ``metadata`` without its ``storage_data`` (which
    Zephon's own slices replace), and every item."""

    metadata: Metadata
    items: list[StockItem]

    def by_file(self) -> dict[str, list[StockItem]]:
        """The items of each file, in offset order."""
        files: dict[str, list[StockItem]] = {}
        for item in self.items:
            files.setdefault(item.file, []).append(item)
        return {name: sorted(items, key=lambda i: i.offset) for name, items in files.items()}


def _refuse(where: str, problem: str, fix: str = _FIX) -> StockCheckpointError:
    return StockCheckpointError(f"{where}: {problem}; {fix}", path=where)


def read_stock_metadata(data: bytes, *, where: str) -> StockCheckpoint:
    """The stock metadata pickled in ``data`` (the file ``where``), read by the allowlist
    unpickler and checked: every item's slice in a valid file name, no transforms, tensor
    chunks with dtype and shape. ``StockCheckpointError`` naming ``where`` otherwise."""
    try:
        md = unpickle_allowed(data, _METADATA_GLOBALS, buildable=_BUILDABLE)
    except UnpickleRefused as exc:
        raise _refuse(
            where, f"refused by the restricted unpickler: {exc}; nothing of it ran"
        ) from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise _refuse(where, f"holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.storage_data, dict):
        raise _refuse(where, "has no storage_data (not written by a FileSystemWriter)")
    items = [_item(index, info, md, where) for index, info in md.storage_data.items()]
    kept = Metadata(
        state_dict_metadata=md.state_dict_metadata,
        planner_data=md.planner_data,
        version=md.version if isinstance(md.version, str) else None,
    )
    return StockCheckpoint(kept, items)


def _item(index: Any, info: Any, md: Metadata, where: str) -> StockItem:
    if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
        raise _refuse(where, f"storage_data has a key of type {type(index).__name__}")
    key = index.fqn
    if not isinstance(info, _StorageInfo):
        raise _refuse(where, f"item {key!r} is stored as {type(info).__name__}")
    if info.transform_descriptors:
        raise _refuse(
            where,
            f"item {key!r} is stored with transforms {list(info.transform_descriptors)!r}",
            "Zephon reads items stored as they are: save without compression or other "
            "transforms (torch's default) and adopt again",
        )
    file, offset, length = info.relative_path, info.offset, info.length
    try:
        validate_file_name(file)
    except (InvalidNameError, TypeError):
        raise _refuse(where, f"item {key!r} names the file {str(file)[:80]!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
        raise _refuse(where, f"item {key!r} has offset {offset!r} and length {length!r}")
    item_md = md.state_dict_metadata.get(key)
    if isinstance(item_md, BytesStorageMetadata):
        return StockItem(index, file, offset, length)
    if not isinstance(item_md, TensorStorageMetadata):
        raise _refuse(where, f"item {key!r} has no tensor or bytes entry in the metadata")
    chunk = next(
        (c for c in item_md.chunks if list(c.offsets) == list(index.offset or [])),
        None,
    )
    if chunk is None:
        raise _refuse(where, f"item {key!r} at offset {index.offset} matches no saved chunk")
    dtype = item_md.properties.dtype
    if not isinstance(dtype, torch.dtype):
        raise _refuse(where, f"item {key!r} has dtype {dtype!r}")
    return StockItem(index, file, offset, length, dtype, tuple(int(s) for s in chunk.sizes))


# -- tensor blobs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _StorageKind:
    """A pickled storage class: typed (``FloatStorage``: ``dtype``) or untyped (bytes)."""

    dtype: torch.dtype | None


@dataclass(frozen=True)
class _StorageRef:
    """What a blob's persistent id names: storage ``key`` of ``numel`` elements of ``kind``."""

    kind: _StorageKind
    key: str
    numel: int


@dataclass(frozen=True)
class _Rebuilt:
    """A tensor rebuild call, recorded instead of run."""

    storage: Any
    storage_offset: Any
    size: Any
    stride: Any
    dtype: Any
    extra: tuple[Any, ...]


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *rest):
    dtype = storage.kind.dtype if isinstance(storage, _StorageRef) else None
    return _Rebuilt(storage, storage_offset, size, stride, dtype, (hooks, *rest))


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *rest):
    return _Rebuilt(storage, storage_offset, size, stride, dtype, (hooks, *rest))


def _storage_classes() -> dict[tuple[str, str], _StorageKind]:
    classes = {("torch.storage", "UntypedStorage"): _StorageKind(None)}
    for dtype, name in torch.storage._dtype_to_storage_type_map().items():
        if not name.startswith("Q"):  # quantized storages: Zephon stores dense tensors only
            classes[("torch", name)] = _StorageKind(dtype)
    return classes


_BLOB_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **_storage_classes(),
    **_DTYPE_GLOBALS,
}


def _persistent(pid: Any) -> _StorageRef:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise UnpickleRefused(f"it holds the persistent id {str(pid)[:60]}")
    _, kind, key, _location, numel = pid
    if not isinstance(kind, _StorageKind) or not isinstance(key, str) or not _count(numel):
        raise UnpickleRefused(f"it holds the persistent id {str(pid)[:60]}")
    return _StorageRef(kind, key, numel)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, tuple | list | torch.Size) and all(_count(v) for v in value):
        return tuple(value)
    return None


def tensor_span(
    blob: bytes | bytearray | memoryview, item: StockItem, *, where: str
) -> tuple[int, int]:
    """``(offset, length)`` of the tensor's own bytes (C order) inside ``blob``, the
    ``torch.save`` blob of tensor ``item`` read from ``where``. Its ``data.pkl`` is read by the
    allowlist unpickler; the tensor must be dense and contiguous, of the metadata's dtype and
    shape, in this host's byte order, its storage stored uncompressed and whole.
    ``StockCheckpointError`` naming the item and file otherwise."""
    view = memoryview(blob)
    what = f"{where} item {item.index.fqn!r}"
    try:
        archive = zipfile.ZipFile(io.BytesIO(view))
        entries = {info.filename: info for info in archive.infolist()}
    except (zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise _refuse(
            what,
            f"is not a whole torch.save blob ({exc}): the file is truncated or damaged",
            "adopt an intact copy of the checkpoint",
        ) from None
    pickles = [name for name in entries if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise _refuse(what, "is a zip archive without one data.pkl (not a torch.save blob)")
    prefix = pickles[0][: -len("data.pkl")]
    try:
        return _span(archive, entries, prefix, view, item)
    except UnpickleRefused as exc:
        raise _refuse(
            what, f"refused by the restricted unpickler: {exc}; nothing of it ran"
        ) from None
    except (ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
        raise _refuse(what, str(exc)) from None


def _span(
    archive: zipfile.ZipFile,
    entries: dict[str, zipfile.ZipInfo],
    prefix: str,
    view: memoryview,
    item: StockItem,
) -> tuple[int, int]:
    byteorder = entries.get(f"{prefix}byteorder")
    if (
        byteorder is not None
        and archive.read(byteorder).decode("ascii", "replace") != sys.byteorder
    ):
        raise ValueError(f"was saved on a host of the other byte order than this {sys.byteorder}")
    rebuilt = unpickle_allowed(
        archive.read(f"{prefix}data.pkl"), _BLOB_GLOBALS, persistent_load=_persistent
    )
    if not isinstance(rebuilt, _Rebuilt) or not isinstance(rebuilt.storage, _StorageRef):
        raise ValueError(f"holds a {type(rebuilt).__name__}, not a plain tensor")
    hooks, *rest = rebuilt.extra
    if hooks or any(rest):
        raise ValueError("is a tensor with hooks or Python attributes, not a plain tensor")
    size, stride, start = _ints(rebuilt.size), _ints(rebuilt.stride), rebuilt.storage_offset
    if size is None or stride is None or len(size) != len(stride) or not _count(start):
        raise ValueError("holds a tensor rebuild with invalid size, stride or offset")
    if rebuilt.dtype != item.dtype or size != item.shape:
        raise ValueError(
            f"holds a {rebuilt.dtype} tensor of shape {list(size)}, but the metadata says "
            f"{item.dtype} {list(item.shape or ())}"
        )
    if not _contiguous(size, stride):
        raise ValueError(f"holds a non-contiguous view (stride {list(stride)} of {list(size)})")
    storage = rebuilt.storage
    info = entries.get(f"{prefix}data/{storage.key}")
    if info is None or info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"has its storage {storage.key!r} missing or compressed")
    element = item.dtype.itemsize
    stored = storage.numel * (element if storage.kind.dtype is not None else 1)
    if info.file_size != stored:
        raise ValueError(f"has storage bytes of {info.file_size}, its pickle says {stored}")
    # the storage bytes from the zip's own directory (stock_format, shared with the writer
    # that stores these blobs): one storage record, uncompressed, inside the blob
    data_start, data_length = raw_span(view)
    if data_length != info.file_size:
        raise ValueError(f"has storage bytes of {data_length}, its directory says {info.file_size}")
    numel = 1
    for s in size:
        numel *= s
    first, length = start * element, numel * element
    if numel and first + length > data_length:
        raise ValueError("ends before its storage does: the file is truncated or damaged")
    return data_start + (first if numel else 0), length


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether elements of ``size`` at ``stride`` lie in C order without gaps (dimensions of
    size 1 may have any stride, as torch's own ``is_contiguous`` allows)."""
    expected = 1
    for s, st in zip(reversed(size), reversed(stride), strict=True):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True
