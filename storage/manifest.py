"""The commit marker's content: a manifest of every file in a checkpoint.

Plain frozen dataclasses serialised as JSON. The marker is written last and exclusively, so a
manifest that exists and parses *is* the statement "this checkpoint is complete"; verification
then checks each listed file against its size and CRC32C.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from storage.checksum import crc32c_of
from storage.errors import CorruptCheckpointError

__all__ = ["FORMAT_VERSION", "FileEntry", "Manifest"]

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One payload file: its path relative to the checkpoint directory, size and CRC32C."""

    name: str
    size: int
    crc32c: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "crc32c": self.crc32c}


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything the commit marker records about one checkpoint."""

    run: str | None
    step: int
    save_id: str
    files: tuple[FileEntry, ...]
    writer: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    committed_at: str = ""
    format_version: int = FORMAT_VERSION

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

    def to_json(self) -> bytes:
        body = {
            "format_version": self.format_version,
            "run": self.run,
            "step": self.step,
            "save_id": self.save_id,
            "total_bytes": self.total_bytes,
            "file_count": self.file_count,
            "files": [entry.to_dict() for entry in self.files],
            "writer": self.writer,
            "metadata": self.metadata,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Parse a marker's bytes; ``where`` (the marker's URL) goes into every error."""
        problem = None
        try:
            body = json.loads(data.decode("utf-8"))
            version = body["format_version"]
            if not isinstance(version, int) or version > FORMAT_VERSION:
                raise CorruptCheckpointError(
                    f"commit marker {where} has format_version {version!r}; this Zephon reads "
                    f"versions up to {FORMAT_VERSION}: upgrade Zephon to read it",
                    path=where,
                )
            files = tuple(
                FileEntry(str(f["name"]), int(f["size"]), str(f["crc32c"])) for f in body["files"]
            )
            manifest = cls(
                run=body["run"],
                step=int(body["step"]),
                save_id=str(body["save_id"]),
                files=files,
                writer=dict(body.get("writer") or {}),
                metadata=dict(body.get("metadata") or {}),
                created_at=str(body.get("created_at", "")),
                committed_at=str(body.get("committed_at", "")),
                format_version=version,
            )
            if "total_bytes" in body and int(body["total_bytes"]) != manifest.total_bytes:
                problem = "total_bytes does not match the sum of file sizes"
        except CorruptCheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            raise CorruptCheckpointError(
                f"commit marker {where} is not a valid manifest ({problem}); the checkpoint "
                "cannot be trusted: delete it (`zephon gc` or CheckpointStore.delete) and "
                "resume from an earlier one",
                path=where,
                problems=[problem],
            )
        return manifest

    def checksum(self) -> str:
        """CRC32C of the serialised manifest: identifies this exact commit in the catalog."""
        return crc32c_of(self.to_json())
