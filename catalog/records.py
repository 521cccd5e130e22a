"""Frozen snapshots of catalog rows: what every ``Catalog`` method returns.

Records are plain values detached from any database session, so callers can keep them, pass
them between threads and print them (``to_dict()`` gives JSON-ready values for ``--json``).
A record is a snapshot: the row may have changed since it was read.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any, Self

from zephon.catalog.errors import replica_label
from zephon.catalog.models import Attempt, Checkpoint, Event, Replica, Run


def _jsonable(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


class _Record:
    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value, timestamps as ISO 8601 strings."""
        return {name: _jsonable(getattr(self, name)) for name in _field_names(type(self))}

    @classmethod
    def _from_row(cls, row: object, **given: Any) -> Self:
        """The record of ``row``: each field not ``given`` is the row's attribute of the same
        name, an enum as its plain string (records hold plain values)."""
        values = dict(given)
        for name in _field_names(cls):
            if name not in values:
                value = getattr(row, name)
                values[name] = str(value) if isinstance(value, Enum) else value
        return cls(**values)


@dataclass(frozen=True, slots=True)
class RunRecord(_Record):
    """One run. ``epoch`` is the current attempt's fencing token (0: never fenced)."""

    name: str
    storage_url: str
    kind: str
    status: str
    total_steps: int | None
    num_to_keep: int | None
    keep_every_steps: int | None
    config: dict[str, Any] | None
    epoch: int
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, row: Run) -> RunRecord:
        return cls._from_row(row)


@dataclass(frozen=True, slots=True)
class RunSummary(_Record):
    """A run plus aggregates over its checkpoints, as ``zephon runs`` shows it.

    ``last_activity`` is the newest ``updated_at`` of the run or any of its checkpoints;
    ``latest_timings`` the timings of the latest committed checkpoint (None: none, or not
    timed).
    """

    run: RunRecord
    committed_count: int
    committed_bytes: int
    latest_step: int | None
    pending_count: int
    last_activity: datetime
    latest_timings: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        values = self.run.to_dict()
        values.update(
            committed_count=self.committed_count,
            committed_bytes=self.committed_bytes,
            latest_step=self.latest_step,
            pending_count=self.pending_count,
            last_activity=_jsonable(self.last_activity),
            latest_timings=self.latest_timings,
        )
        return values


@dataclass(frozen=True, slots=True)
class CheckpointRecord(_Record):
    """One checkpoint row. ``path`` is the URL of its ``save-<step>`` directory.

    ``save_id`` is what ``mark_committed``/``mark_failed`` must present; ``epoch`` the attempt
    that armed the row (0: unfenced); ``claimed_by`` is the claim token ``mark_deleted`` must
    present while the row is ``deleting``. ``timings`` maps phase names (``write_s``,
    ``commit_s``, ``total_s``, ``stall_s``...) to seconds of the save that committed it; None
    for a row nobody timed.
    """

    run: str
    step: int
    state: str
    path: str
    save_id: str
    epoch: int
    bytes: int | None
    file_count: int | None
    manifest_checksum: str | None
    pinned: bool
    metadata: dict[str, Any] | None
    failure_reason: str | None
    claimed_by: str | None
    claimed_at: datetime | None
    created_at: datetime
    committed_at: datetime | None
    updated_at: datetime
    timings: dict[str, float] | None = None
    #: of ``bytes``, those this save stored itself (a deduplicated save's new chunks and its
    #: plain files); None: it stored all of them
    stored_bytes: int | None = None

    @classmethod
    def of(cls, row: Checkpoint, run: str) -> CheckpointRecord:
        return cls._from_row(row, run=run, metadata=row.meta)


@dataclass(frozen=True, slots=True)
class ReplicaRecord(_Record):
    """One copy of a checkpoint on one storage tier (a row of ``checkpoint_replicas``).

    ``tier`` is ``"local"`` (a node-local disk; ``host`` names the node) or ``"save_dir"``
    (the job's shared storage; ``host`` is ``""``). ``location`` is the replica's checkpoint
    URL, ``save_id`` the save it belongs to, ``state`` one of pending, committed, failed,
    deleted; ``bytes`` and ``timings`` (phase -> seconds: ``local_s``, ``upload_s``...) are
    those of this copy, set when it committed.
    """

    run: str
    step: int
    tier: str
    host: str
    location: str
    save_id: str
    state: str
    bytes: int | None
    timings: dict[str, float] | None
    failure_reason: str | None
    created_at: datetime
    committed_at: datetime | None
    updated_at: datetime

    @classmethod
    def of(cls, row: Replica, run: str) -> ReplicaRecord:
        return cls._from_row(row, run=run)

    @property
    def label(self) -> str:
        """``local replica on host n1`` or ``save_dir replica``, for messages."""
        return replica_label(self.tier, self.host)


@dataclass(frozen=True, slots=True)
class AttemptRecord(_Record):
    """One registered attempt (one start of a job) of a run.

    ``epoch`` is its fencing token; ``attempt_id`` the uuid hex identifying it; ``host``,
    ``pid`` and ``started_at`` say which process it is; ``resumed_from`` is the step it resumed
    from (None: a fresh start) once ``decided`` (until then it has not chosen yet);
    ``registered_at`` when the catalog learnt of it.
    """

    run: str
    epoch: int
    attempt_id: str
    host: str
    pid: int
    started_at: datetime
    resumed_from: int | None
    registered_at: datetime
    decided: bool = True

    @classmethod
    def of(cls, row: Attempt, run: str) -> AttemptRecord:
        return cls._from_row(row, run=run, decided=row.decided_at is not None)

    @property
    def process(self) -> str:
        """``host h1, pid 4242, started 2026-12-01T10:00:00+00:00``: which process it is."""
        return f"host {self.host}, pid {self.pid}, started {self.started_at.isoformat()}"

    def describe(self) -> str:
        """``attempt epoch 5 (host h1, pid 4242, started ...)``, for messages."""
        return f"attempt epoch {self.epoch} ({self.process})"


@dataclass(frozen=True, slots=True)
class AttemptRegistration(_Record):
    """What ``register_attempt`` did: the attempt now current, and the steps it abandoned.

    ``abandoned`` lists, ascending, the steps of older attempts above the resume point that
    were moved to ``stale`` in the registering transaction.
    """

    attempt: AttemptRecord
    abandoned: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**self.attempt.to_dict(), "abandoned": list(self.abandoned)}


@dataclass(frozen=True, slots=True)
class EventRecord(_Record):
    id: int
    at: datetime
    actor: str
    action: str
    run: str | None
    step: int | None
    detail: dict[str, Any] | None

    @classmethod
    def of(cls, row: Event) -> EventRecord:
        return cls._from_row(row, run=row.run_name)
