"""What ``zephon checkpoints`` and ``zephon runs`` say about a save's timings and its copies:
its duration, its write rate, and the storage tiers it is on. Pure functions of catalog
records (``CheckpointRecord.timings``, ``ReplicaRecord``), so the table and the tests agree.

A row nobody timed (older rows, a tool that does not time) shows ``-``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from catalog import CheckpointRecord, ReplicaRecord
from zephon.cli.render import human_rate, human_seconds

__all__ = ["duration", "duration_s", "rate", "stall", "tiers"]

#: checkpoint states whose copies the tiers column describes (the others are gone, going,
#: or not a checkpoint)
_LIVE = ("pending", "committed")


def duration_s(timings: Mapping[str, float] | None) -> float | None:
    """Seconds from the save's begin to its commit: ``total_s``, or the local tier's save
    plus its upload (``local_s + upload_s``) when only those are known; None otherwise."""
    if not timings:
        return None
    if "total_s" in timings:
        return timings["total_s"]
    if "local_s" in timings and "upload_s" in timings:
        return timings["local_s"] + timings["upload_s"]
    return None


def duration(timings: Mapping[str, float] | None) -> str:
    return human_seconds(duration_s(timings))


def rate(size: int | None, timings: Mapping[str, float] | None) -> str:
    """MB/s of writing the checkpoint: ``bytes / (write_s + commit_s)``."""
    if not timings or "write_s" not in timings or "commit_s" not in timings:
        return "-"
    return human_rate(size, timings["write_s"] + timings["commit_s"])


def stall(timings: Mapping[str, float] | None) -> str:
    """How long the save blocked training (``stall_s``)."""
    return human_seconds((timings or {}).get("stall_s"))


def tiers(row: CheckpointRecord, replicas: Iterable[ReplicaRecord]) -> str:
    """The tiers the checkpoint is on: ``local, save_dir``, ``save_dir``, ``local (upload
    pending)``, ``local (upload failed)``; ``-`` when it is on none (or not live).

    A checkpoint without replica rows was saved straight to its ``save_dir``: committed means
    it is there. With rows, a tier counts when one of its replicas is committed; a local copy
    whose ``save_dir`` replica is failed is ``upload failed``, one whose ``save_dir`` replica
    is pending or not started yet ``upload pending``.
    """
    if row.state not in _LIVE:
        return "-"
    copies = list(replicas)
    if not copies:
        return "save_dir" if row.state == "committed" else "-"
    committed = {r.tier for r in copies if r.state == "committed"}
    on = [t for t in ("local", "save_dir") if t in committed]
    if on == ["local"]:
        upload = [r.state for r in copies if r.tier == "save_dir"]
        return "local (upload failed)" if upload == ["failed"] else "local (upload pending)"
    return ", ".join(on) or "-"
