"""The checkpoint state machine on the save path: begin, commit, fail, pin, sync repairs.

Internal to the catalog: each function runs inside a write session opened by ``Catalog``.

Every transition is one guarded ``UPDATE ... WHERE state = <expected> [AND save_id = <mine>]
RETURNING``: the database, not Python, decides who wins, so two processes can never both move
the same row. When the guard matches nothing the row is re-read to say precisely why
(not found, already done by this same attempt, or taken over by someone else).

::

    (none) --begin--> pending --commit--> committed --claim--> deleting --mark_deleted--> deleted
                      pending --fail----> failed
    failed | deleted | pending(older attempt) --begin (re-arm, new save id)--> pending
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from catalog.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidTransitionError,
    StateConflictError,
)
from catalog.models import Checkpoint, CheckpointState, Run

_BEGIN_RETRIES = 5

PENDING = CheckpointState.PENDING
COMMITTED = CheckpointState.COMMITTED
DELETING = CheckpointState.DELETING
DELETED = CheckpointState.DELETED
FAILED = CheckpointState.FAILED

# Columns describing one attempt's result; re-arming clears them so nothing of the previous
# attempt survives into the new one.
_CLEARED_ON_REARM: dict[str, Any] = {
    "bytes": None,
    "file_count": None,
    "manifest_checksum": None,
    "meta": None,
    "failure_reason": None,
    "claimed_by": None,
    "claimed_at": None,
    "committed_at": None,
}


class SyncOutcome(StrEnum):
    """What ``upsert_committed`` did with a checkpoint found complete on storage."""

    INSERTED = "inserted"  # no row existed
    PROMOTED = "promoted"  # pending, failed or deleted row made committed
    UPDATED = "updated"  # committed row whose recorded facts differed from storage
    UNCHANGED = "unchanged"  # committed row already matching storage
    SKIPPED = "skipped"  # row is being deleted by gc; left to it


def new_save_id() -> str:
    return uuid.uuid4().hex


def load(session: Session, run_id: int, step: int) -> Checkpoint | None:
    statement = select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == step)
    # populate_existing: a retry must see the row as it is now, not as first loaded.
    return session.scalars(statement.execution_options(populate_existing=True)).one_or_none()


def guarded_update(
    session: Session, conditions: list[ColumnElement[bool]], values: dict[str, Any]
) -> list[Checkpoint]:
    """Apply ``values`` to the rows matching ``conditions``; returns the rows actually moved."""
    statement = (
        update(Checkpoint)
        .where(*conditions)
        .values(**values)
        .returning(Checkpoint)
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    return list(session.scalars(statement))


def _insert(session: Session, row: Checkpoint) -> bool:
    try:
        # Savepoint: losing the unique (run_id, step) race must not poison the transaction.
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        return False
    return True


def begin(
    session: Session, url: str, run: Run, step: int, path: str, now: datetime
) -> tuple[Checkpoint, str, dict[str, Any] | None]:
    """Arm ``(run, step)`` as pending under a fresh save id.

    Returns ``(row, "begun" | "rearmed", previous)`` where ``previous`` describes the state and
    attempt that were re-armed. Raises ``CheckpointExistsError`` for a committed step and
    ``InvalidTransitionError`` for one being deleted.
    """
    for _ in range(_BEGIN_RETRIES):
        attempt = new_save_id()
        row = load(session, run.id, step)
        if row is None:
            fresh = Checkpoint(
                run_id=run.id,
                step=step,
                state=PENDING,
                path=path,
                save_id=attempt,
                pinned=False,
                created_at=now,
                updated_at=now,
            )
            if _insert(session, fresh):
                return fresh, "begun", None
            continue  # a concurrent begin inserted the row: decide again on what it holds
        if row.state == COMMITTED:
            raise CheckpointExistsError(url, run.name, step, row.path)
        if row.state == DELETING:
            raise InvalidTransitionError(
                url,
                run.name,
                step,
                row.state,
                "begin",
                f"gc ({row.claimed_by}) is deleting it; save again after `zephon gc` "
                f"finishes, or under another step",
            )
        previous = _snapshot(row)
        moved = guarded_update(
            session,
            [
                Checkpoint.id == row.id,
                Checkpoint.state == row.state,
                Checkpoint.save_id == row.save_id,
            ],
            {
                **_CLEARED_ON_REARM,
                "state": PENDING,
                "save_id": attempt,
                "path": path,
                "created_at": now,
                "updated_at": now,
            },
        )
        if moved:
            return moved[0], "rearmed", previous
    raise InvalidTransitionError(
        url,
        run.name,
        step,
        "contended",
        "begin",
        f"{_BEGIN_RETRIES} concurrent begins raced for it; check for two jobs saving this run",
    )


def _snapshot(row: Checkpoint) -> dict[str, Any]:
    return {"state": row.state, "save_id": row.save_id, "reason": row.failure_reason}


def _finish_attempt(
    session: Session,
    url: str,
    run: Run,
    step: int,
    save_id: str,
    target: CheckpointState,
    values: dict[str, Any],
    action: str,
) -> tuple[Checkpoint, bool]:
    moved = guarded_update(
        session,
        [
            Checkpoint.run_id == run.id,
            Checkpoint.step == step,
            Checkpoint.state == PENDING,
            Checkpoint.save_id == save_id,
        ],
        {**values, "state": target},
    )
    if moved:
        return moved[0], True
    row = load(session, run.id, step)
    if row is None:
        raise CheckpointNotFoundError(url, run.name, step)
    if row.state == target and row.save_id == save_id:
        # Already done by this attempt: a retried call, or the marker probe promoted it.
        return row, False
    raise StateConflictError(url, run.name, step, row.state, action, save_id, row.save_id)


def commit(
    session: Session,
    url: str,
    run: Run,
    step: int,
    save_id: str,
    facts: dict[str, Any],
    now: datetime,
) -> tuple[Checkpoint, bool]:
    """pending -> committed for this attempt; ``(row, moved)``; idempotent for the same attempt."""
    values = {**facts, "committed_at": now, "updated_at": now, "failure_reason": None}
    return _finish_attempt(session, url, run, step, save_id, COMMITTED, values, "commit")


def fail(
    session: Session, url: str, run: Run, step: int, save_id: str, reason: str, now: datetime
) -> tuple[Checkpoint, bool]:
    """pending -> failed for this attempt; ``(row, moved)``; idempotent for the same attempt."""
    values = {"failure_reason": reason, "updated_at": now}
    return _finish_attempt(session, url, run, step, save_id, FAILED, values, "fail")


def set_pinned(
    session: Session, url: str, run: Run, step: int, pinned: bool, now: datetime
) -> tuple[Checkpoint, bool]:
    """Pin (pending or committed rows only) or unpin (any row); ``(row, changed)``."""
    conditions = [
        Checkpoint.run_id == run.id,
        Checkpoint.step == step,
        Checkpoint.pinned.is_not(pinned),
    ]
    if pinned:
        conditions.append(Checkpoint.state.in_([PENDING, COMMITTED]))
    moved = guarded_update(session, conditions, {"pinned": pinned, "updated_at": now})
    if moved:
        return moved[0], True
    row = load(session, run.id, step)
    if row is None:
        raise CheckpointNotFoundError(url, run.name, step)
    if row.pinned == pinned:
        return row, False
    raise InvalidTransitionError(
        url,
        run.name,
        step,
        row.state,
        "pin",
        "only pending or committed checkpoints can be pinned; save the step again first",
    )


def upsert_committed(
    session: Session,
    run: Run,
    step: int,
    facts: dict[str, Any],
    committed_at: datetime,
    now: datetime,
) -> tuple[Checkpoint | None, SyncOutcome]:
    """Record a checkpoint found complete on storage (``zephon sync``); idempotent.

    Storage is the source of truth: a complete checkpoint is committed whatever its row said,
    except while gc holds it (``deleting``), since gc may already have removed its marker.
    Promotion keeps the row's save id, so a still-running writer's ``mark_committed``
    succeeds as a no-op.
    """
    for _ in range(_BEGIN_RETRIES):
        row = load(session, run.id, step)
        if row is None:
            fresh = Checkpoint(
                run_id=run.id,
                step=step,
                state=COMMITTED,
                save_id="sync-" + new_save_id(),
                pinned=False,
                created_at=now,
                committed_at=committed_at,
                updated_at=now,
                **facts,
            )
            if _insert(session, fresh):
                return fresh, SyncOutcome.INSERTED
            continue
        if row.state == DELETING:
            return row, SyncOutcome.SKIPPED
        if row.state == COMMITTED:
            differs = {k: v for k, v in facts.items() if getattr(row, k) != v}
            if not differs:
                return row, SyncOutcome.UNCHANGED
            values: dict[str, Any] = {**differs, "updated_at": now}
            outcome = SyncOutcome.UPDATED
        else:
            values = {
                **facts,
                "state": COMMITTED,
                "committed_at": committed_at,
                "updated_at": now,
                "failure_reason": None,
                "claimed_by": None,
                "claimed_at": None,
            }
            outcome = SyncOutcome.PROMOTED
        moved = guarded_update(
            session,
            [
                Checkpoint.id == row.id,
                Checkpoint.state == row.state,
                Checkpoint.save_id == row.save_id,
            ],
            values,
        )
        if moved:
            return moved[0], outcome
    return None, SyncOutcome.SKIPPED


def mark_missing(
    session: Session, run: Run, step: int, reason: str, now: datetime
) -> Checkpoint | None:
    """committed -> deleted because storage no longer holds its marker; the moved row or None.

    The caller holds the run's ``update`` lock (see ``catalog.runs``), because removing a
    committed row can move an older one into the newest ``num_to_keep``.
    """
    moved = guarded_update(
        session,
        [Checkpoint.run_id == run.id, Checkpoint.step == step, Checkpoint.state == COMMITTED],
        {"state": DELETED, "failure_reason": reason, "updated_at": now},
    )
    return moved[0] if moved else None
