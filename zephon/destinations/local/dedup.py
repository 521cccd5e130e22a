"""Deduplicated uploads from a tier (docs/dedup.md, "Layout", the tiers): which files of a local
checkpoint go to ``save_dir`` as content-addressed chunks, where each is cut, and against which
base.

A tier keeps its own copy as plain files; its uploader stores the shard files
(``<subdir>/__<rank>_<i>.distcp``) in save_dir through ``CheckpointWriter.deduplicate`` and
``open_chunked``, listing the base's instance of every chunk whose content the base holds.

- **The base** is the newest checkpoint committed in save_dir of the run's history: the one
  this uploader committed last, else save_dir's latest under the run's lineage. Retention
  never deletes it, so the sweep rule holds for the upload as for a direct save.
- **The cut** is the direct save's: a shard's pieces come from the checkpoint's DCP metadata
  (the JSON file its marker names under ``metadata.dcp.metadata``, usually carried inline by
  the marker), each tensor's bytes of at least ``DIRECT_BYTES`` on their own (a larger one in
  ``DEFAULT_MAX_CHUNK`` pieces), the small ones and the blob headers gathered into pieces of up
  to ``GATHER_BYTES``. Only the slices' file, offset and length are read; a shard the metadata
  does not describe is cut every ``GATHER_BYTES``. The cut decides only how well the bytes
  deduplicate, never what is stored: every byte still goes out and is checked by CRC32C.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from zephon.storage import DEFAULT_MAX_CHUNK, ChunkRef, FileEntry, Manifest

__all__ = ["DIRECT_BYTES", "GATHER_BYTES", "DedupPlan", "is_shard", "pieces_of", "plan_upload"]

log = logging.getLogger("zephon")

#: a tensor's bytes of at least this many are a chunk (or several) of their own
DIRECT_BYTES = 64 << 10
#: smaller runs of bytes are gathered into chunks of up to this many
GATHER_BYTES = 1 << 20
#: a shard file of a DCP save, by its last path component
_SHARD = re.compile(r"__\d{1,7}_\d{1,7}\.distcp")


def is_shard(name: str) -> bool:
    """Whether ``name`` is a DCP shard file (``[subdir/]__<rank>_<i>.distcp``)."""
    return bool(_SHARD.fullmatch(name.rsplit("/", 1)[-1]))


@dataclass(frozen=True)
class DedupPlan:
    """Rank 0's word to every rank for one upload: the base's chunks and each shard's cut.

    ``base``: every chunk reference of the base (empty: no base, everything is uploaded);
    ``pieces``: shard file name -> the sizes of its pieces, in order (they add up to the
    file's size). A shard absent from ``pieces`` is cut every ``GATHER_BYTES``."""

    base: tuple[ChunkRef, ...] = ()
    pieces: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: the base's step and save id, for messages and tests (None: no base)
    base_step: int | None = None
    base_save_id: str | None = None

    def base_map(self) -> dict[str, ChunkRef]:
        """The base by content (SHA-256 hex), as ``CheckpointWriter.deduplicate`` takes it."""
        return {ref.sha256: ref for ref in self.base}

    def cut(self, entry: FileEntry) -> list[int] | None:
        """The sizes of ``entry``'s pieces if it goes out as chunks, else None (a plain file)."""
        if entry.size == 0 or not is_shard(entry.name):
            return None
        known = self.pieces.get(entry.name)
        if known is not None and sum(known) == entry.size:
            return list(known)
        return _grid(entry.size, GATHER_BYTES)


def plan_upload(
    manifest: Manifest, base: Manifest | None, read: Callable[[str], bytes]
) -> DedupPlan:
    """Rank 0: the plan of the upload of the local checkpoint ``manifest`` against ``base``
    (save_dir's newest checkpoint of the history, or None). ``read(name)`` reads one file of
    the local checkpoint (the DCP metadata, when the marker does not carry it)."""
    refs: dict[str, ChunkRef] = {}
    if base is not None and base.chunk_scope == "run":  # an upload keeps chunks per run
        for ref in base.chunk_refs():
            refs.setdefault(ref.sha256, ref)
    shards = {e.name: e.size for e in manifest.files if is_shard(e.name)}
    slices = _dcp_slices(manifest, read) if shards else {}
    pieces = {
        name: tuple(pieces_of(size, slices.get(name, ())))
        for name, size in shards.items()
        if name in slices
    }
    return DedupPlan(
        tuple(refs.values()),
        pieces,
        base.step if base is not None else None,
        base.save_id if base is not None else None,
    )


def pieces_of(size: int, slices: Iterable[tuple[int, int]]) -> list[int]:
    """The sizes of the pieces a file of ``size`` bytes is cut into, given its items' byte
    ranges ``(offset, length)``: the cut of module docstring."""
    bounds = {0, size}
    for offset, length in slices:
        if 0 <= offset <= size and length >= 0:
            bounds.add(offset)
            bounds.add(min(size, offset + length))
    edges = sorted(bounds)
    out: list[int] = []
    gathered = 0
    for start, end in zip(edges, edges[1:], strict=False):
        length = end - start
        if length >= DIRECT_BYTES:
            if gathered:
                out.append(gathered)
                gathered = 0
            out.extend(_grid(length, DEFAULT_MAX_CHUNK))
            continue
        if gathered and gathered + length > GATHER_BYTES:
            out.append(gathered)
            gathered = 0
        gathered += length
    if gathered:
        out.append(gathered)
    return out


def _grid(size: int, step: int) -> list[int]:
    return [min(step, size - start) for start in range(0, size, step)] or [0]


def _dcp_slices(
    manifest: Manifest, read: Callable[[str], bytes]
) -> dict[str, list[tuple[int, int]]]:
    """Each shard file's item byte ranges, from the checkpoint's DCP metadata; {} when it has
    none or it cannot be read (the shards are then cut on a grid)."""
    dcp = manifest.metadata.get("dcp") if isinstance(manifest.metadata, dict) else None
    name = dcp.get("metadata") if isinstance(dcp, dict) else None
    if not isinstance(name, str) or manifest.file(name) is None:
        return {}
    try:
        data = manifest.inline_bytes(name)
        if data is None:
            data = read(name)
        body: Any = json.loads(data)
        out: dict[str, list[tuple[int, int]]] = {}
        for item in body["storage_data"]:
            offset, length = item["byte_offset"], item["length"]
            if isinstance(offset, int) and isinstance(length, int):
                out.setdefault(str(item["file"]), []).append((offset, length))
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("zephon: the DCP metadata of step %d is not used to cut: %s", manifest.step, exc)
        return {}


def local_reader(payload: str) -> Callable[[str], bytes]:
    """``read(name)`` of the local payload directory ``payload``."""

    def read(name: str) -> bytes:
        with open(os.path.join(payload, *name.split("/")), "rb") as source:
            return source.read()

    return read
