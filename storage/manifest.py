"""The commit marker's content: a manifest of every file in a checkpoint.

Plain frozen dataclasses serialised as JSON. The marker is written last and exclusively, so a
manifest that exists and parses *is* the statement "this checkpoint is complete"; verification
then checks each listed file against its size and CRC32C.

A manifest is input like any other: ``from_json`` validates every field (file names, sizes,
counts, checksums, the payload directory, the fencing token) so that every consumer (reader,
verify, load, gc) refuses a hostile or damaged one the same way, as ``CorruptCheckpointError``.

Format 2 (this version) records the fencing token of the attempt that wrote the checkpoint
(``epoch``, ``attempt_id``) and the per-save payload directory (``payload``, the ``save_id``):
files live at ``save-<step>/<payload>/<name>``. Format 1 (before fencing) is read as epoch 0
with its files directly in ``save-<step>/``.

A marker may also carry copies of a few files it lists (``inline``: zlib-compressed, then
base64, at most ``MAX_INLINE_BYTES`` compressed in all): whoever reads the marker then has
those files' bytes in the same request, e.g. a DCP load its metadata. A copy is used only if
its size and CRC32C match the file's entry (``inline_bytes``); the file itself is always
written too.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from zephon.storage.checksum import crc32c_of, is_encoded_crc32c
from zephon.storage.chunks import CHUNK_SCOPES, MAX_CHUNKS_PER_FILE, ChunkRef
from zephon.storage.errors import CorruptCheckpointError, InvalidNameError
from zephon.storage.jsondoc import parse_json
from zephon.storage.layout import MAX_STEP, SAVE_ID, validate_file_name

__all__ = [
    "FORMAT_VERSION",
    "MAX_INLINE_BYTES",
    "MAX_INLINE_FILE",
    "PLAIN_FORMAT_VERSION",
    "FileEntry",
    "Manifest",
    "SAVE_ID",
    "inline_copy",
    "validate_save_id",
]

FORMAT_VERSION = 3
#: the format a manifest without chunk references is written in (readable by older versions)
PLAIN_FORMAT_VERSION = 2
#: no single file of a checkpoint is larger than this (1 PiB); anything above is damage
MAX_FILE_SIZE = 1 << 50
#: no checkpoint lists more files than this; anything above is damage or hostility
MAX_FILES = 1_000_000
#: the most compressed bytes of file copies one marker carries (``Manifest.inline``): a marker
#: is read by every scan and load, so it stays small (DCP metadata compresses about 16-fold)
MAX_INLINE_BYTES = 256 << 10
#: no file larger than this is copied into a marker (nor expanded from one)
MAX_INLINE_FILE = 64 << 20


def inline_copy(data: bytes | bytearray | memoryview) -> str:
    """A file's copy as a marker carries it (``Manifest.inline``): zlib, then base64."""
    return base64.b64encode(zlib.compress(data)).decode("ascii")


def validate_save_id(save_id: str) -> str:
    """A save id is 1-64 characters of ``[A-Za-z0-9_-]`` (it names a directory)."""
    if not isinstance(save_id, str) or not SAVE_ID.fullmatch(save_id):
        raise InvalidNameError(
            f"invalid save id {save_id!r}: use 1-64 characters of A-Z a-z 0-9 _ -",
            path=str(save_id)[:80],
        )
    return save_id


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One payload file: its path relative to the payload directory, size and CRC32C; a
    deduplicated file (``chunks``) is stored as those chunk instances instead, in order."""

    name: str
    size: int
    crc32c: str
    chunks: tuple[ChunkRef, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name, "size": self.size, "crc32c": self.crc32c}
        if self.chunks is not None:
            body["chunks"] = [chunk.to_list() for chunk in self.chunks]
        return body


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything the commit marker records about one checkpoint.

    ``save_id`` names this one save of the step (its payload directory, ``payload``);
    ``epoch`` and ``attempt_id`` name the attempt (job start) that wrote it: the fencing token
    readers compare with the run's lineage and the catalog's row. ``inline`` maps a few
    listed files' names to a base64 copy of their bytes (``inline_bytes``).
    """

    run: str | None
    step: int
    save_id: str
    files: tuple[FileEntry, ...]
    epoch: int = 0
    attempt_id: str = ""
    payload: str = ""
    writer: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    committed_at: str = ""
    format_version: int = PLAIN_FORMAT_VERSION
    inline: dict[str, str] = field(default_factory=dict)
    #: where the chunks of a deduplicated save are (``storage.chunks.CHUNK_SCOPES``)
    chunk_scope: str = "run"

    def __post_init__(self) -> None:
        # Format 3 is format 2 plus chunk references: a manifest is written in it only when
        # a file has chunks, so that an older Zephon refuses it by name instead of reading a
        # deduplicated file as a missing one.
        if self.format_version == PLAIN_FORMAT_VERSION and self.chunked:
            object.__setattr__(self, "format_version", FORMAT_VERSION)

    @property
    def chunked(self) -> bool:
        """Whether any file is stored as chunks (a deduplicated save)."""
        return any(entry.chunks is not None for entry in self.files)

    def chunk_refs(self) -> list[ChunkRef]:
        """Every chunk reference of the manifest, in file order (repeats included)."""
        return [chunk for entry in self.files for chunk in entry.chunks or ()]

    @property
    def new_bytes(self) -> int:
        """Bytes this save stored itself: its plain files and the chunk instances it uploaded
        (each once), not the chunks it references from earlier saves."""
        own: dict[str, int] = {}
        plain = 0
        for entry in self.files:
            if entry.chunks is None:
                plain += entry.size
            for chunk in entry.chunks or ():
                if chunk.save_id == self.save_id:
                    own[chunk.name] = chunk.size
        return plain + sum(own.values())

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    @property
    def file_count(self) -> int:
        return len(self.files)

    def file(self, name: str) -> FileEntry | None:
        for entry in self.files:
            if entry.name == name:
                return entry
        return None

    def inline_bytes(self, name: str) -> bytes | None:
        """The copy of file ``name`` this marker carries, if it has one whose size and CRC32C
        match the file's entry; else None (read the file)."""
        copy, entry = self.inline.get(name), self.file(name)
        if copy is None or entry is None or entry.size > MAX_INLINE_FILE:
            return None
        try:
            # never expanded beyond the entry's size (plus one byte, to see a longer copy)
            data = zlib.decompressobj().decompress(
                base64.b64decode(copy, validate=True), entry.size + 1
            )
        except (binascii.Error, ValueError, zlib.error):
            return None
        if len(data) != entry.size or crc32c_of(data) != entry.crc32c:
            return None
        return data

    def to_json(self) -> bytes:
        """The marker's bytes."""
        return self._serialise(with_copies=True)

    def _serialise(self, *, with_copies: bool) -> bytes:
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "run": self.run,
            "step": self.step,
            "save_id": self.save_id,
            "epoch": self.epoch,
            "attempt_id": self.attempt_id,
            "payload": self.payload,
            "total_bytes": self.total_bytes,
            "file_count": self.file_count,
            "files": [entry.to_dict() for entry in self.files],
            "writer": self.writer,
            "metadata": self.metadata,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
        }
        if self.inline and with_copies:  # absent otherwise: markers as they were before
            body["inline"] = self.inline
        if self.chunked:
            body["chunk_scope"] = self.chunk_scope
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and validate a marker's bytes; ``where`` (the marker's URL) goes into every
        error. Anything malformed raises ``CorruptCheckpointError`` naming the problem."""
        try:
            body = parse_json(data)
            if not isinstance(body, dict):
                raise ValueError("the marker is not a JSON object")
            version = body["format_version"]
            if not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise ValueError(f"format_version {version!r} is not a version number")
            if version > FORMAT_VERSION:
                raise CorruptCheckpointError(
                    f"commit marker {where} has format_version {version}; this Zephon reads "
                    f"versions up to {FORMAT_VERSION}: upgrade Zephon to read it",
                    path=where,
                    problems=[f"format_version {version} is newer than {FORMAT_VERSION}"],
                )
            manifest = cls._parse(body, version)
        except CorruptCheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            problem = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            raise CorruptCheckpointError(
                f"commit marker {where} is not a valid manifest ({problem[:300]}); the "
                "checkpoint cannot be trusted: resume from an earlier one, and remove it with "
                "`zephon gc --corrupt` once inspected",
                path=where,
                problems=[problem[:300]],
            ) from None
        return manifest

    @classmethod
    def _parse(cls, body: dict[str, Any], version: int) -> Manifest:
        run = body["run"]
        if run is not None and not isinstance(run, str):
            raise ValueError(f"run {run!r} is not a string")
        step = _count(body["step"], "step")
        if version == 1:
            save_id, epoch, attempt_id, payload = str(body["attempt_id"]), 0, "", ""
        else:
            save_id = body["save_id"]
            epoch = _count(body["epoch"], "epoch")
            attempt_id = body.get("attempt_id", "")
            payload = body["payload"]
            if not isinstance(attempt_id, str) or len(attempt_id) > 64:
                raise ValueError(f"attempt_id {attempt_id!r} is not an attempt id")
            if payload != save_id:
                raise ValueError(f"payload directory {payload!r} is not the save id {save_id!r}")
        if not isinstance(save_id, str) or not SAVE_ID.fullmatch(save_id):
            raise ValueError(f"save id {save_id!r} is not 1-64 characters of [A-Za-z0-9_-]")
        raw_files = body["files"]
        if not isinstance(raw_files, list) or len(raw_files) > MAX_FILES:
            raise ValueError("files is not a list of at most 1,000,000 entries")
        files = tuple(_entry(f, chunked=version >= 3) for f in raw_files)
        names = [f.name for f in files]
        if len(set(names)) != len(names):
            raise ValueError("a file name is listed twice")
        if "file_count" in body and _count(body["file_count"], "file_count") != len(files):
            raise ValueError("file_count does not match the files listed")
        total = sum(f.size for f in files)
        if "total_bytes" in body and _count(body["total_bytes"], "total_bytes") != total:
            raise ValueError("total_bytes does not match the sum of file sizes")
        return cls(
            run=run,
            step=step,
            save_id=save_id,
            files=files,
            epoch=epoch,
            attempt_id=attempt_id,
            payload=payload,
            writer=_mapping(body.get("writer"), "writer"),
            metadata=_mapping(body.get("metadata"), "metadata"),
            created_at=str(body.get("created_at", "")),
            committed_at=str(body.get("committed_at", "")),
            format_version=version,
            inline=_inline(body.get("inline"), set(names)),
            chunk_scope=_scope(body.get("chunk_scope", "run")),
        )

    def checksum(self) -> str:
        """CRC32C of the serialised manifest: identifies this exact commit in the catalog.
        The file copies are left out: they only repeat files the manifest lists (and are
        checked against them), and a version that does not know them computes the same."""
        return crc32c_of(self._serialise(with_copies=False))


def _scope(value: Any) -> str:
    if value not in CHUNK_SCOPES:
        raise ValueError(f"chunk_scope {str(value)[:40]!r} is not one of {', '.join(CHUNK_SCOPES)}")
    return value


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        raise ValueError(f"{what} {str(value)[:40]!r} is not an integer from 0 to {MAX_STEP}")
    return value


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    return dict(value)


def _inline(value: Any, listed: set[str]) -> dict[str, str]:
    """The marker's file copies: names it lists, mapped to base64 text of bounded size."""
    copies = _mapping(value, "inline")
    total = 0
    for name, copy in copies.items():
        if name not in listed:
            raise ValueError(f"inline copy of {name[:80]!r}, a file the marker does not list")
        if not isinstance(copy, str):
            raise ValueError(f"inline copy of {name[:80]!r} is not base64 text")
        total += len(copy)
    if total > MAX_INLINE_BYTES * 4 // 3 + 4 * len(copies):
        raise ValueError(f"inline copies of {total} base64 characters, beyond the marker's limit")
    return copies


def _entry(raw: Any, *, chunked: bool) -> FileEntry:
    if not isinstance(raw, dict):
        raise ValueError(f"file entry {str(raw)[:60]!r} is not an object")
    name = raw["name"]
    try:
        validate_file_name(name)
    except InvalidNameError:
        raise ValueError(
            f"file name {str(name)[:80]!r} is not a plain relative path (no '..', no leading "
            "'/', no backslashes or control characters)"
        ) from None
    size = raw["size"]
    if isinstance(size, int) and not isinstance(size, bool) and size > MAX_FILE_SIZE:
        shown = str(size) if size <= MAX_STEP else f"{str(size)[:20]}... ({len(str(size))} digits)"
        raise ValueError(f"size of {name[:80]!r} is {shown} bytes, beyond any real checkpoint")
    size = _count(size, f"size of {name[:80]!r}")
    crc = raw["crc32c"]
    if not is_encoded_crc32c(crc):
        raise ValueError(f"crc32c of {name[:80]!r} is not a base64 CRC32C")
    raw_chunks = raw.get("chunks") if chunked else None
    if raw_chunks is None:
        return FileEntry(name, size, crc)
    if not isinstance(raw_chunks, list) or len(raw_chunks) > MAX_CHUNKS_PER_FILE:
        raise ValueError(f"chunks of {name[:80]!r} is not a list of chunk references")
    chunks = tuple(ChunkRef.from_list(c, max_size=MAX_FILE_SIZE) for c in raw_chunks)
    if sum(c.size for c in chunks) != size:
        raise ValueError(f"chunks of {name[:80]!r} do not add up to its size {size}")
    return FileEntry(name, size, crc, chunks)
