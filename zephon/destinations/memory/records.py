"""What a node's memory directory holds: the per-rank records of a memory save, and the
listing of a node's holdings that the resume compares across nodes (docs/tiers.md, "The
memory tier").

In host memory, each node's directory holds only some of a save's files: those its own
ranks wrote and the peer copies of other nodes' files. Rank 0's commit marker lists the files
on rank 0's node only. So every rank also writes a small **record** of its own files (names,
sizes, CRC32C) into the save's payload directory, beside them, and each record travels with
its rank's files to the peer nodes. A save is complete across the job when rank 0's marker
and one record per rank of the world that saved it are held somewhere, and every file they
name is held, with its size, on some node. Records are JSON read as data, never run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from zephon.storage import FileEntry, Manifest, StorageError

__all__ = [
    "RECORD_DIR",
    "Holding",
    "NodeHoldings",
    "read_record",
    "record_name",
    "scan",
    "write_record",
]

log = logging.getLogger("zephon")

#: a payload directory's sub-directory holding the records of the ranks whose files are there
RECORD_DIR = "_zephon_memory"
#: the marker's name in a step directory (storage's layout)
_MARKER = "_COMMIT"
_STEP_DIR = re.compile(r"^save-(\d+)$")
_RECORD = re.compile(r"^rank-(\d+)\.json$")
#: records larger than this are not records (a damaged or foreign file)
_MAX_RECORD_BYTES = 64 << 20


def record_name(rank: int) -> str:
    """The record of ``rank`` relative to its save's payload directory."""
    return f"{RECORD_DIR}/rank-{rank}.json"


def write_record(
    payload_path: str,
    *,
    rank: int,
    world_size: int,
    step: int,
    save_id: str,
    files: Iterable[FileEntry],
) -> str:
    """Write ``rank``'s record of the files it wrote for save ``save_id`` of ``step`` into
    its payload directory (a temporary name, then a rename: a reader sees all or nothing).
    Returns the record's path."""
    document = {
        "format": 1,
        "rank": rank,
        "world_size": world_size,
        "step": step,
        "save_id": save_id,
        "files": [entry.to_dict() for entry in files],
    }
    path = os.path.join(payload_path, record_name(rank))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        json.dump(document, out, separators=(",", ":"))
    os.replace(temporary, path)
    return path


def read_record(path: str) -> dict[str, Any] | None:
    """A record as plain data, or None if it is not one (missing, too large, not JSON, not of
    this format): a record that cannot be read counts as absent, never as an error."""
    try:
        if os.path.getsize(path) > _MAX_RECORD_BYTES:
            return None
        with open(path, encoding="utf-8") as source:
            document = json.load(source)
        files = [FileEntry(**entry).to_dict() for entry in document["files"]]
        return {
            "rank": int(document["rank"]),
            "world_size": int(document["world_size"]),
            "step": int(document["step"]),
            "save_id": str(document["save_id"]),
            "files": files,
        }
    except (OSError, ValueError, TypeError, KeyError):
        return None


@dataclass
class Holding:
    """One save (``step``, ``save_id``) as one node holds it: its records, the payload files
    present with their sizes, and the step's marker if it names this save."""

    step: int
    save_id: str
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    marker: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "save_id": self.save_id,
            "records": {str(rank): record for rank, record in self.records.items()},
            "files": self.files,
            "marker": self.marker,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Holding:
        return cls(
            step=int(data["step"]),
            save_id=str(data["save_id"]),
            records={int(rank): record for rank, record in data["records"].items()},
            files={str(name): int(size) for name, size in data["files"].items()},
            marker=data.get("marker"),
        )


#: what one node holds: its holdings, newest step first
NodeHoldings = list[Holding]


def scan(run_path: str, *, below: int | None = None) -> NodeHoldings:
    """Every save in a memory directory's run path (``<memory_dir>/<run>``), newest step
    first: records, files and the marker naming it. Cheap: a RAM disk, a few saves kept.
    ``below``: only steps below this one."""
    holdings: NodeHoldings = []
    try:
        names = os.listdir(run_path)
    except FileNotFoundError:
        return holdings
    steps = sorted(
        (int(match.group(1)) for name in names if (match := _STEP_DIR.match(name))),
        reverse=True,
    )
    for step in steps:
        if below is not None and step >= below:
            continue
        step_path = os.path.join(run_path, f"save-{step}")
        marker_save, marker_text = _marker(os.path.join(step_path, _MARKER))
        with contextlib.suppress(OSError):
            for save_id in sorted(os.listdir(step_path)):
                payload = os.path.join(step_path, save_id)
                if save_id.startswith("_") or not os.path.isdir(payload):
                    continue
                holding = Holding(step, save_id)
                holding.files = _files(payload)
                holding.records = _records(payload, step, save_id)
                if marker_save == save_id:
                    holding.marker = marker_text
                if holding.files or holding.records or holding.marker:
                    holdings.append(holding)
    return holdings


def _marker(path: str) -> tuple[str | None, str | None]:
    """The save id a marker names and its text (None, None: none, or not a marker)."""
    try:
        with open(path, "rb") as source:
            data = source.read(_MAX_RECORD_BYTES)
        manifest = Manifest.from_json(data, where=path)
        return manifest.payload, data.decode("utf-8")
    except (OSError, ValueError, StorageError):
        return None, None


def _files(payload: str) -> dict[str, int]:
    """The files under a payload directory (names relative to it), records and temporary
    files left out."""
    found: dict[str, int] = {}
    for directory, dirs, files in os.walk(payload):
        relative = os.path.relpath(directory, payload)
        if relative == RECORD_DIR:
            dirs[:] = []
            continue
        for name in files:
            if name.endswith(".tmp") or ".part" in name:
                continue
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                key = name if relative == "." else f"{relative}/{name}".replace(os.sep, "/")
                found[key] = os.path.getsize(path)
    return found


def _records(payload: str, step: int, save_id: str) -> dict[int, dict[str, Any]]:
    records: dict[int, dict[str, Any]] = {}
    directory = os.path.join(payload, RECORD_DIR)
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            match = _RECORD.match(name)
            if not match:
                continue
            record = read_record(os.path.join(directory, name))
            if (
                record is not None
                and record["rank"] == int(match.group(1))
                and record["step"] == step
                and record["save_id"] == save_id
            ):
                records[record["rank"]] = record
    return records
