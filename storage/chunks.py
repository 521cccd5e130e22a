"""Content-addressed chunks: the payload of a deduplicated save (``dedup``).

A deduplicated file is not stored under its save's payload directory. Its bytes are cut into
chunks (at the boundaries the writer marks, e.g. each tensor, and at most ``max_chunk``
bytes each), and each chunk is one object of the run's chunk directory::

    <run>/_chunks/<sha256 hex>.<save_id>

named by its content's SHA-256 *and* by the save that uploaded it (an *instance*). A chunk's
name never changes meaning: nobody else writes it, nobody rewrites it, and a save that finds
the same content in its *base* (the newest committed checkpoint of its history, which
retention never deletes) lists that instance instead of uploading the bytes again. Because
instances are per save, a sweep that deletes an unreferenced instance can never remove bytes a
concurrent save has just uploaded under the same content hash, and a stale attempt's chunks
are only ever its own.

The manifest lists each such file with its chunk references (``ChunkRef``: hash, uploading
save, size, CRC32C); readers read the ranges they need from the chunks, and every byte is still
checked by CRC32C, never by the hash. See docs/dedup.md for the contract, the sweep's rule and
why it is safe under kills and fencing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from zephon.storage.checksum import is_encoded_crc32c
from zephon.storage.layout import CHUNK_DIR, SAVE_ID

__all__ = [
    "CHUNK_DIR",
    "CHUNK_SCOPES",
    "LEASE_DIR",
    "ChunkRef",
    "DEFAULT_MAX_CHUNK",
    "MAX_CHUNKS_PER_FILE",
    "chunk_epoch",
    "parse_chunk_name",
]

#: where a deduplicated save's chunks live: ``run`` (``<run>/_chunks/``) or ``save_dir`` (the
#: store's root, ``<save_dir>/_chunks/``, shared by every run under it)
CHUNK_SCOPES = ("run", "save_dir")
#: inside a chunk directory: one lease per save in flight that lists chunks of a base
#: (``<save_id>.json``, naming the saves whose instances it may list); docs/dedup.md
LEASE_DIR = "_leases"
#: the largest chunk a writer cuts by default (a tensor above it is cut into pieces of this
#: size, so a large tensor whose rows change only in part is deduplicated in part)
DEFAULT_MAX_CHUNK = 8 << 20
#: no file lists more chunks than this; anything above is damage or hostility
MAX_CHUNKS_PER_FILE = 1 << 22
_HASH = re.compile(r"[0-9a-f]{64}")
_EPOCH = re.compile(r"e(\d{1,18})-")


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk of a deduplicated file: its content's SHA-256 (hex), the save that uploaded
    this instance, its size and CRC32C (base64, as ``FileEntry``)."""

    sha256: str
    save_id: str
    size: int
    crc32c: str

    @property
    def name(self) -> str:
        """The instance's object name in the chunk directory."""
        return f"{self.sha256}.{self.save_id}"

    def to_list(self) -> list[Any]:
        return [self.sha256, self.save_id, self.size, self.crc32c]

    @classmethod
    def from_list(cls, raw: Any, *, max_size: int) -> ChunkRef:
        """Parse one manifest reference; ``ValueError`` naming what is wrong."""
        if not isinstance(raw, list) or len(raw) != 4:
            raise ValueError(f"chunk reference {str(raw)[:80]!r} is not [sha256, save, size, crc]")
        sha, save_id, size, crc = raw
        if not isinstance(sha, str) or not _HASH.fullmatch(sha):
            raise ValueError(f"chunk hash {str(sha)[:80]!r} is not 64 hex digits")
        if not isinstance(save_id, str) or not SAVE_ID.fullmatch(save_id):
            raise ValueError(f"chunk save id {str(save_id)[:80]!r} is not a save id")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= max_size:
            raise ValueError(f"chunk size {str(size)[:40]!r} is not 1 to {max_size} bytes")
        if not is_encoded_crc32c(crc):
            raise ValueError(f"chunk crc32c {str(crc)[:40]!r} is not a base64 CRC32C")
        return cls(sha, save_id, size, crc)


def parse_chunk_name(name: str) -> tuple[str, str] | None:
    """``(sha256, save_id)`` of a chunk directory entry, or None for anything else."""
    sha, dot, save_id = name.partition(".")
    if not dot or not _HASH.fullmatch(sha) or not SAVE_ID.fullmatch(save_id):
        return None
    return sha, save_id


def lease_body(save_id: str, uploaders: set[str]) -> bytes:
    """A save's lease: the saves whose chunk instances it may list (its base's uploaders)."""
    return json.dumps({"save_id": save_id, "uploaders": sorted(uploaders)}).encode()


def lease_uploaders(data: bytes) -> set[str] | None:
    """The uploaders a lease protects; None if it is not a lease (damage: it protects
    nothing, and goes once it is older than the grace)."""
    try:
        body = json.loads(data)
        uploaders = body["uploaders"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(uploaders, list) or not all(
        isinstance(u, str) and SAVE_ID.fullmatch(u) for u in uploaders
    ):
        return None
    return set(uploaders)


def chunk_epoch(save_id: str) -> int | None:
    """The epoch of the attempt that uploaded a chunk, from its save id (``e<epoch>-...``);
    None for a save id of another form."""
    match = _EPOCH.match(save_id)
    return int(match.group(1)) if match else None
