"""What ``zephon checkpoints`` and ``zephon runs`` say about a save's timings and its copies:
its duration, its write rate, and the storage tiers it is on. Pure functions of catalog
records (``CheckpointRecord.timings``, ``ReplicaRecord``), so the table and the tests agree.

A row nobody timed (older rows, a tool that does not time) shows ``-``, and so does a phase
whose value is not a number of seconds (a row edited by hand).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime

from zephon.catalog import CheckpointRecord, ReplicaRecord
from zephon.cli.render import human_bytes, human_rate, human_seconds

__all__ = [
    "LOCAL_ONLY",
    "duration",
    "duration_s",
    "local_only",
    "local_only_row",
    "rate",
    "seconds",
    "stall",
    "tiers",
]

#: the state ``zephon checkpoints`` shows for a step only a local tier holds (no checkpoint row)
LOCAL_ONLY = "local only"

#: checkpoint states whose copies the tiers column describes (the others are gone, going,
#: or not a checkpoint)
_LIVE = ("pending", "committed")


def seconds(timings: object, phase: str) -> float | None:
    """The seconds ``timings`` gives ``phase``, or None (unknown) unless it is a finite,
    non-negative number. The catalog checks timings when a save records them, but a row
    edited by hand or written by another tool may hold anything: a table shows such a
    value as unknown rather than failing on it."""
    if not isinstance(timings, Mapping):
        return None
    value = timings.get(phase)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def duration_s(timings: Mapping[str, float] | None) -> float | None:
    """Seconds from the save's begin to its commit: ``total_s``, or the local tier's save
    plus its upload (``local_s + upload_s``) when only those are known; None otherwise."""
    total = seconds(timings, "total_s")
    if total is not None:
        return total
    local, upload = seconds(timings, "local_s"), seconds(timings, "upload_s")
    return None if local is None or upload is None else local + upload


def duration(timings: Mapping[str, float] | None) -> str:
    return human_seconds(duration_s(timings))


def rate(size: int | None, timings: Mapping[str, float] | None) -> str:
    """MB/s of writing the checkpoint: ``bytes / (write_s + commit_s)``."""
    write, commit = seconds(timings, "write_s"), seconds(timings, "commit_s")
    if write is None or commit is None:
        return "-"
    return human_rate(size, write + commit)


def stall(timings: Mapping[str, float] | None) -> str:
    """How long the save blocked training (``stall_s``)."""
    return human_seconds(seconds(timings, "stall_s"))


#: the tiers a save commits to before save_dir (the memory tier, the local tier)
_FIRST_TIERS = ("memory", "local")


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
    on = [t for t in ("memory", "local", "save_dir") if t in committed]
    if on and "save_dir" not in on:
        upload = [r.state for r in copies if r.tier == "save_dir"]
        return f"{', '.join(on)} (upload {'failed' if upload == ['failed'] else 'pending'})"
    return ", ".join(on) or "-"


def local_only(
    copies: Mapping[int, Iterable[ReplicaRecord]], known: set[int]
) -> dict[int, list[ReplicaRecord]]:
    """Steps without a checkpoint row (not in ``known``) that a local tier holds or is
    writing: a local save whose upload never began (a node that died right after its local
    commit, or uploads queued behind backpressure). Ordered by step."""
    held: dict[int, list[ReplicaRecord]] = {}
    for step in sorted(copies):
        replicas = list(copies[step])
        if step not in known and any(
            r.tier in _FIRST_TIERS and r.state in ("pending", "committed") for r in replicas
        ):
            held[step] = replicas
    return held


def local_only_row(
    step: int,
    replicas: Iterable[ReplicaRecord],
    committed: Callable[[datetime | None], str | None],
) -> tuple:
    """The ``zephon checkpoints`` row of such a step, in the table's columns: its size and
    local timings from the newest local replica, the tiers ``local (upload not begun)`` or
    ``local (saving)``, its commit time as ``committed`` shows it, and the local copy's
    location as its path."""
    local = [r for r in replicas if r.tier in _FIRST_TIERS and r.state in ("pending", "committed")]
    copy = max(local, key=lambda r: r.updated_at)
    phase = "memory_s" if copy.tier == "memory" else "local_s"
    return (
        step,
        LOCAL_ONLY,
        None,
        human_bytes(copy.bytes),
        None,
        human_seconds(seconds(copy.timings, phase)),
        "-",
        f"{copy.tier} (upload not begun)" if copy.state == "committed" else f"{copy.tier} (saving)",
        "",
        committed(copy.committed_at),
        copy.location,
    )
