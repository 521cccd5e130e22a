"""DCP ``Metadata`` as versioned JSON, so a checkpoint never has to be unpickled to be read.

torch's own writers pickle ``Metadata``; loading such a file runs arbitrary code. Zephon writes
the same object graph as JSON: dtypes, layouts and memory formats by name, sizes as lists,
``storage_data`` as a list keyed by ``MetadataIndex`` fields. Decoding accepts only the names in
the tables below, builds plain dataclasses, and reports any problem as the storage layer's
``CorruptCheckpointError`` naming the file.

Versions: 2 records the CRC32C of every slice (``crc32c``, base64 of the big-endian value, as
in the storage manifest), so a load can check each item's bytes as they arrive. Version 1 files
(no per-slice CRC) are still read; their slices have ``crc32c=None``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from zephon import dtypes
from zephon.dcp.errors import MetadataEncodingError
from zephon.storage import CorruptCheckpointError, decode_crc32c, parse_json

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ShardSlice",
    "decode_metadata",
    "dtype_from_name",
    "dtype_name",
    "encode_metadata",
]

FORMAT = "zephon-dcp-metadata"
FORMAT_VERSION = 2
#: the oldest version still read: 1 (slices without ``crc32c``)
_OLDEST_VERSION = 1

_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}


@dataclass(frozen=True)
class ShardSlice:
    """Where one saved item's bytes are: ``length`` bytes at ``offset`` of shard ``file``
    (a name relative to the checkpoint directory).

    ``encoding`` is ``"raw"`` for a tensor chunk (its elements in C order, ``dtype`` and
    ``shape`` given, host byte order recorded in the file header) or ``"bytes"`` for a non-tensor
    item, which holds whatever DCP's planner serialised.

    ``crc32c`` is the CRC32C of those ``length`` bytes, encoded like the storage manifest's
    (``storage.checksum.encode_crc32c``); None only in checkpoints of format version 1.
    """

    file: str
    offset: int
    length: int
    encoding: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    crc32c: str | None = None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return dtypes.dtype_name(dtype)
    except ValueError as exc:
        raise MetadataEncodingError(str(exc)) from None


dtype_from_name = dtypes.dtype_from_name


def _name_in(table: dict[str, Any], value: Any, what: str) -> str:
    for name, known in table.items():
        if known == value:
            return name
    raise MetadataEncodingError(f"{what} {value!r} cannot be stored in Zephon's DCP metadata")


def _ints(values: Any, what: str) -> list[int]:
    """``values`` if it is a list of integers (decoding only: see "decoding" below)."""
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"{what} must be a list of integers, got {values!r}")
    return values


# -- encoding -------------------------------------------------------------------------------------


def _encode_item(fqn: str, md: Any) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        return {"kind": "bytes"}
    if not isinstance(md, TensorStorageMetadata):
        raise MetadataEncodingError(
            f"state_dict_metadata[{fqn!r}] is a {type(md).__name__}; Zephon stores tensors and "
            "bytes items only"
        )
    props = md.properties
    return {
        "kind": "tensor",
        "dtype": dtype_name(props.dtype),
        "size": list(md.size),
        "layout": _name_in(_LAYOUTS, props.layout, f"layout of {fqn!r}"),
        "requires_grad": bool(props.requires_grad),
        "memory_format": _name_in(_MEMORY_FORMATS, props.memory_format, f"format of {fqn!r}"),
        "pin_memory": bool(props.pin_memory),
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
    }


def _encode_planner_data(value: Any) -> dict[str, Any]:
    if value is None:
        return {"kind": "none"}
    # DefaultSavePlanner's flatten mapping: flat key -> path of str/int keys in the nested dict.
    if isinstance(value, dict) and all(
        isinstance(k, str)
        and isinstance(p, tuple | list)
        and all(isinstance(e, str | int) and not isinstance(e, bool) for e in p)
        for k, p in value.items()
    ):
        return {"kind": "flatten_mapping", "value": {k: list(p) for k, p in value.items()}}
    try:
        text = json.dumps(value)
        exact = json.loads(text) == value
    except (TypeError, ValueError):
        exact = False
    if not exact:
        raise MetadataEncodingError(
            f"planner_data of type {type(value).__name__} does not survive a JSON round trip; "
            "Zephon never pickles metadata: use DefaultSavePlanner, or a planner whose "
            "planner_data is plain JSON (dicts, lists, str, numbers)"
        )
    return {"kind": "json", "value": value}


def _encode_storage_data(storage_data: Any) -> list[dict[str, Any]]:
    if not isinstance(storage_data, dict):
        raise MetadataEncodingError(
            f"storage_data must map MetadataIndex to ShardSlice, got {type(storage_data).__name__}"
        )
    out = []
    for index, where in storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(where, ShardSlice):
            raise MetadataEncodingError(
                f"storage_data entry {index!r} -> {type(where).__name__} was not written by "
                "ZephonStorageWriter; Zephon's metadata only records its own shard slices"
            )
        try:
            decode_crc32c(where.crc32c)
        except ValueError:
            raise MetadataEncodingError(
                f"storage_data entry {index.fqn!r} has crc32c {where.crc32c!r}; format version "
                f"{FORMAT_VERSION} needs the encoded CRC32C of every slice "
                "(storage.checksum.encode_crc32c)"
            ) from None
        out.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "file": where.file,
                "byte_offset": where.offset,
                "length": where.length,
                "encoding": where.encoding,
                "dtype": where.dtype,
                "shape": None if where.shape is None else list(where.shape),
                "crc32c": where.crc32c,
            }
        )
    return out


def _encode_storage_meta(meta: StorageMeta | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    return {
        "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
        "save_id": meta.save_id,
        "load_id": meta.load_id,
        "modules": list(meta.modules),
    }


def encode_metadata(metadata: Metadata) -> bytes:
    """The JSON bytes of ``metadata``; ``MetadataEncodingError`` names any field that has no JSON
    form (nothing is ever pickled)."""
    body = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "byteorder": sys.byteorder,
        "dcp_version": metadata.version,
        "state_dict_metadata": {
            fqn: _encode_item(fqn, md) for fqn, md in metadata.state_dict_metadata.items()
        },
        "planner_data": _encode_planner_data(metadata.planner_data),
        "storage_data": _encode_storage_data(metadata.storage_data or {}),
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
    }
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")


# -- decoding -------------------------------------------------------------------------------------
#
# The helpers below raise plain ValueError: only decode_metadata calls them, and it turns every
# one (with KeyError, TypeError...) into the CorruptCheckpointError naming the file, so none of
# them reaches a caller as it is.


def _decode_item(fqn: str, body: dict[str, Any]) -> TensorStorageMetadata | BytesStorageMetadata:
    kind = body["kind"]
    if kind == "bytes":
        return BytesStorageMetadata()
    if kind != "tensor":
        raise ValueError(f"item {fqn!r} has unknown kind {kind!r}")
    layout, fmt = body["layout"], body["memory_format"]
    if layout not in _LAYOUTS or fmt not in _MEMORY_FORMATS:
        raise ValueError(f"item {fqn!r} has unknown layout {layout!r} or memory format {fmt!r}")
    properties = TensorProperties(
        dtype=dtype_from_name(body["dtype"]),
        layout=_LAYOUTS[layout],
        requires_grad=bool(body["requires_grad"]),
        memory_format=_MEMORY_FORMATS[fmt],
        pin_memory=bool(body["pin_memory"]),
    )
    chunks = [
        ChunkStorageMetadata(
            offsets=torch.Size(_ints(c["offsets"], f"chunk offsets of {fqn!r}")),
            sizes=torch.Size(_ints(c["sizes"], f"chunk sizes of {fqn!r}")),
        )
        for c in body["chunks"]
    ]
    return TensorStorageMetadata(
        properties=properties,
        size=torch.Size(_ints(body["size"], f"size of {fqn!r}")),
        chunks=chunks,
    )


def _decode_planner_data(body: dict[str, Any]) -> Any:
    kind = body["kind"]
    if kind == "none":
        return None
    if kind == "flatten_mapping":
        return {str(k): tuple(p) for k, p in body["value"].items()}
    if kind == "json":
        return body["value"]
    raise ValueError(f"planner_data has unknown kind {kind!r}")


def _decode_crc(entry: dict[str, Any], fqn: str, version: int) -> str | None:
    value = entry.get("crc32c")
    if version == 1:
        if value is not None:
            raise ValueError(f"item {fqn!r} has a crc32c, which format version 1 does not have")
        return None
    try:
        decode_crc32c(value)
    except ValueError as exc:
        raise ValueError(f"item {fqn!r} has no valid crc32c: {exc}") from None
    return value


def _decode_storage_data(
    entries: list[dict[str, Any]], version: int
) -> dict[MetadataIndex, ShardSlice]:
    out: dict[MetadataIndex, ShardSlice] = {}
    for e in entries:
        offset = e["offset"]
        index = MetadataIndex(
            str(e["fqn"]),
            None if offset is None else _ints(offset, "storage offset"),
            None if e["index"] is None else int(e["index"]),
        )
        encoding = e["encoding"]
        if encoding not in {"raw", "bytes"}:
            raise ValueError(f"item {index.fqn!r} has unknown encoding {encoding!r}")
        shape = e["shape"]
        if encoding == "raw":
            dtype_from_name(e["dtype"])
            if shape is None:
                raise ValueError(f"raw item {index.fqn!r} has no shape")
        start, length = int(e["byte_offset"]), int(e["length"])
        if start < 0 or length < 0:
            raise ValueError(f"item {index.fqn!r} has a negative offset or length")
        out[index] = ShardSlice(
            file=str(e["file"]),
            offset=start,
            length=length,
            encoding=encoding,
            dtype=e["dtype"],
            shape=None if shape is None else tuple(_ints(shape, f"shape of {index.fqn!r}")),
            crc32c=_decode_crc(e, index.fqn, version),
        )
    return out


def _decode_storage_meta(body: dict[str, Any] | None) -> StorageMeta | None:
    if body is None:
        return None
    return StorageMeta(
        checkpoint_id=body.get("checkpoint_id"),
        save_id=body.get("save_id"),
        load_id=body.get("load_id"),
        modules=[str(m) for m in body.get("modules") or []],
    )


def decode_metadata(data: bytes, *, where: str) -> Metadata:
    """Parse metadata written by ``encode_metadata`` (format version 1 or 2). Raises
    ``CorruptCheckpointError`` naming ``where`` (the file's URL) if it is not such a file (a
    version-2 slice without a valid ``crc32c`` included), or was written by a newer Zephon or
    on a host of the other byte order."""
    try:
        body = parse_json(data)
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"it is not a {FORMAT} file")
        version = body.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"DCP metadata {where} has format_version {version!r}; this Zephon reads "
                f"versions up to {FORMAT_VERSION}: upgrade Zephon to load it",
                path=where,
                problems=[f"{where}: format_version {version!r}"],
            )
        if version < _OLDEST_VERSION:
            raise ValueError(f"format_version {version} was never written")
        if body.get("byteorder") != sys.byteorder:
            raise ValueError(
                f"it was written on a {body.get('byteorder')}-endian host and this one is "
                f"{sys.byteorder}-endian"
            )
        metadata = Metadata(
            state_dict_metadata={
                str(fqn): _decode_item(fqn, item)
                for fqn, item in body["state_dict_metadata"].items()
            },
            planner_data=_decode_planner_data(body["planner_data"]),
            storage_data=_decode_storage_data(body["storage_data"], version),
            storage_meta=_decode_storage_meta(body.get("storage_meta")),
            version=body.get("dcp_version"),
        )
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
        raise CorruptCheckpointError(
            f"DCP metadata {where} cannot be read ({problem}); the checkpoint cannot be "
            "loaded: resume from an earlier checkpoint",
            path=where,
            problems=[f"{where}: {problem}"],
        ) from exc
    return metadata
