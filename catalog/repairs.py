"""Repairs from what storage holds: a verified commit marker, a missing one, a corrupt payload.

Internal to the catalog: each function runs inside a write session opened by ``Catalog``.
Storage is the source of truth, so these calls move rows towards what storage says, with the
same guarded ``UPDATE ... RETURNING`` as the save path; a guard that misses is re-read and
decided again. They never raise for a state they cannot change: they report what they did.

``upsert_committed`` is the one "storage has a complete, verified marker of save S at step N"
repair, used by the resume probe, gc and ``zephon sync``. Its caller holds the run row's
``share`` lock, so the lineage it checks cannot change before it commits (a registration
waits for it; see ``catalog.attempts``).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import ColumnElement, and_, or_
from sqlalchemy.orm import Session

from zephon.catalog import attempts, guarded, replicas
from zephon.catalog.models import Checkpoint, CheckpointState, Run
from zephon.catalog.transitions import insert, load

_RETRIES = 5

PENDING = CheckpointState.PENDING
COMMITTED = CheckpointState.COMMITTED
DELETING = CheckpointState.DELETING
DELETED = CheckpointState.DELETED
FAILED = CheckpointState.FAILED
CORRUPT = CheckpointState.CORRUPT
STALE = CheckpointState.STALE


class SyncOutcome(StrEnum):
    """What ``upsert_committed`` did with a checkpoint found complete on storage."""

    INSERTED = "inserted"  # no row existed
    PROMOTED = "promoted"  # pending (same save), failed or deleted row made committed
    UPDATED = "updated"  # committed row whose save or recorded facts differed from storage
    UNCHANGED = "unchanged"  # committed row already matching storage
    SKIPPED = "skipped"  # a live newer save, a stale or corrupt row, or gc is deleting it
    STALE = "stale"  # the marker's attempt is abandoned or unregistered: never promoted


def upsert_committed(
    session: Session,
    run: Run,
    step: int,
    save_id: str,
    epoch: int,
    facts: dict[str, Any],
    committed_at: datetime,
    now: datetime,
) -> tuple[Checkpoint | None, SyncOutcome, bool]:
    """Record that storage holds a complete marker of ``save_id`` (attempt ``epoch``) at ``step``.

    Returns ``(row or None, outcome, changed)``; ``changed`` says whether a row was written.

    Defence in depth comes first: a marker whose attempt is not registered yet (epoch above
    ``runs.epoch``), or whose ``(epoch, step)`` a newer attempt abandoned, is never promoted
    (``STALE``); a row still holding that save in pending, committed or failed is moved to
    ``stale``, and where there is no row at all a ``stale`` one is inserted, so that gc finds
    the marker and deletes it after the grace through the claim protocol. Otherwise, by the
    row's state:

    ====================  ==========================================================
    no row                inserted committed with the marker's save and epoch
    pending, same save    promoted (the writer's own ``mark_committed`` is then a no-op)
    pending, other save   skipped: a newer save is being written
    committed, same save  unchanged, or updated when the recorded facts differ
    committed, other      updated: save, epoch and facts replaced (storage is the truth)
    failed, deleted       promoted with the marker's save and epoch
    stale, corrupt        skipped: out of the lineage, or known bad
    deleting              skipped: gc may already have removed the marker
    ====================  ==========================================================
    """
    marker = {**facts, "save_id": save_id, "epoch": epoch}
    if epoch > run.epoch:
        reason = f"epoch {epoch} was never registered (the run's is {run.epoch})"
        # A row that exists is not this marker's to judge (an unregistered epoch cannot have
        # begun it): only a missing row is recorded.
        return _stale_marker(session, run, step, marker, reason, committed_at, now, live=False)
    abandoner = attempts.abandoning(session, run.id, epoch, step)
    if abandoner is not None:
        reason = attempts.abandonment_reason(abandoner.epoch, abandoner.resumed_from)
        return _stale_marker(session, run, step, marker, reason, committed_at, now)
    for _ in range(_RETRIES):
        row = load(session, run.id, step)
        if row is None:
            fresh = insert(session, run, step, COMMITTED, now, committed_at=committed_at, **marker)
            if fresh is not None:
                return fresh, SyncOutcome.INSERTED, True
            continue
        if row.state in (STALE, CORRUPT, DELETING) or (
            row.state == PENDING and row.save_id != save_id
        ):
            return row, SyncOutcome.SKIPPED, False
        if row.state == COMMITTED:
            differs = {k: v for k, v in marker.items() if getattr(row, k) != v}
            if not differs:
                return row, SyncOutcome.UNCHANGED, False
            values: dict[str, Any] = {**differs, "updated_at": now}
            if row.save_id != save_id:
                values["committed_at"] = committed_at
                values.update(replicas.CLEARED_TIMINGS)  # the other save's, not this marker's
            outcome = SyncOutcome.UPDATED
        else:
            values = {
                **marker,
                "state": COMMITTED,
                "committed_at": committed_at,
                "updated_at": now,
                "failure_reason": None,
                "claimed_by": None,
                "claimed_at": None,
            }
            if row.save_id != save_id:
                values.update(replicas.CLEARED_TIMINGS)  # the other save's, not this marker's
            outcome = SyncOutcome.PROMOTED
        moved = guarded.update_one(session, Checkpoint, guarded.unchanged(Checkpoint, row), values)
        if moved is not None:
            return moved, outcome, True
    return load(session, run.id, step), SyncOutcome.SKIPPED, False


def _stale_marker(
    session: Session,
    run: Run,
    step: int,
    marker: dict[str, Any],
    reason: str,
    committed_at: datetime,
    now: datetime,
    *,
    live: bool = True,
) -> tuple[Checkpoint | None, SyncOutcome, bool]:
    """The marker belongs to an abandoned lineage or an unregistered attempt: make sure it has
    a row (``stale``) for gc to claim, and, with ``live``, that a live row of that save is
    staled too."""
    save_id = marker["save_id"]
    for _ in range(_RETRIES):
        row = load(session, run.id, step)
        if row is None:
            fresh = insert(
                session,
                run,
                step,
                STALE,
                now,
                failure_reason=reason,
                committed_at=committed_at,
                **marker,
            )
            if fresh is not None:
                return fresh, SyncOutcome.STALE, True
            continue
        if not live or row.save_id != save_id or row.state not in attempts.ABANDONABLE:
            return row, SyncOutcome.STALE, False
        moved = guarded.update_one(
            session,
            Checkpoint,
            guarded.unchanged(Checkpoint, row),
            {"state": STALE, "failure_reason": reason, "updated_at": now},
        )
        if moved is not None:
            return moved, SyncOutcome.STALE, True
    return load(session, run.id, step), SyncOutcome.STALE, False


def mark_missing(
    session: Session, run: Run, step: int, reason: str, now: datetime
) -> Checkpoint | None:
    """committed -> deleted because storage no longer holds its marker; the moved row or None.
    The step's committed ``save_dir`` replica goes with it (``replicas.save_dir_copy_gone``).

    The caller holds the run's ``update`` lock (see ``catalog.runs``), because removing a
    committed row can move an older one into the newest ``num_to_keep``.
    """
    row = guarded.update_one(
        session,
        Checkpoint,
        [Checkpoint.run_id == run.id, Checkpoint.step == step, Checkpoint.state == COMMITTED],
        {"state": DELETED, "failure_reason": reason, "updated_at": now},
    )
    if row is not None:
        replicas.save_dir_copy_gone(session, run.id, step, now)
    return row


def mark_corrupt(
    session: Session, run: Run, step: int, save_id: str, reason: str, now: datetime
) -> Checkpoint | None:
    """The row of ``save_id`` -> corrupt because its stored checkpoint failed verification.

    Moves pending, committed, failed rows and rows that sync marked deleted (marker missing,
    no claim token); returns the moved row or None. Left alone: another save's row, rows gc is
    deleting or has deleted (their files are going or gone: nothing left to inspect), stale
    rows (gc removes them anyway) and rows already corrupt. The caller holds the run's
    ``update`` lock, as for ``mark_missing``: a committed row leaves the retention count.
    """
    movable = or_(
        Checkpoint.state.in_([PENDING, COMMITTED, FAILED]),
        and_(Checkpoint.state == DELETED, Checkpoint.claimed_by.is_(None)),
    )
    return _mark_save(session, run, step, save_id, movable, CORRUPT, reason, now)


def mark_stale(
    session: Session, run: Run, step: int, save_id: str, reason: str, now: datetime
) -> Checkpoint | None:
    """The row of ``save_id`` -> stale because storage's lineage abandoned its marker (an
    attempt the catalog learnt of late, or an unregistered epoch): pending, committed or
    failed rows of that save move; returns the moved row or None. The caller holds the run's
    ``update`` lock: a committed row leaves the retention count."""
    movable = Checkpoint.state.in_([PENDING, COMMITTED, FAILED])
    return _mark_save(session, run, step, save_id, movable, STALE, reason, now)


def _mark_save(
    session: Session,
    run: Run,
    step: int,
    save_id: str,
    movable: ColumnElement[bool],
    state: CheckpointState,
    reason: str,
    now: datetime,
) -> Checkpoint | None:
    """The row of ``save_id`` at ``step``, if ``movable``, -> ``state`` for ``reason``."""
    return guarded.update_one(
        session,
        Checkpoint,
        [
            Checkpoint.run_id == run.id,
            Checkpoint.step == step,
            Checkpoint.save_id == save_id,
            movable,
        ],
        {"state": state, "failure_reason": reason, "updated_at": now},
    )
