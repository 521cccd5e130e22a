"""The checkpoint state machine on the save path: begin, commit, fail, pin.

Internal to the catalog: each function runs inside a write session opened by ``Catalog``, which
has already applied the attempt fence (``catalog.attempts``) where the call is fenced. Repairs
from what storage holds (sync, the resume probe, corruption) are in ``catalog.repairs``.

Every transition is one guarded ``UPDATE ... WHERE state = <expected> [AND save_id = <mine>]
RETURNING``: the database, not Python, decides who wins, so two processes can never both move
the same row. When the guard matches nothing the row is re-read to say precisely why
(not found, already done by this same save, or taken over by someone else).

::

    (none) --begin--> pending --commit--> committed --claim--> deleting --mark_deleted--> deleted
                      pending --fail----> failed
    failed | deleted | stale | corrupt | pending(older save) --begin (re-arm, new save)--> pending
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from zephon.catalog import guarded
from zephon.catalog.errors import (
    CheckpointExistsError,
    CheckpointRecordNotFoundError,
    InvalidTransitionError,
    StateConflictError,
)
from zephon.catalog.models import Checkpoint, CheckpointState, Run
from zephon.catalog.replicas import CLEARED_TIMINGS

_BEGIN_RETRIES = 5

PENDING = CheckpointState.PENDING
COMMITTED = CheckpointState.COMMITTED
DELETING = CheckpointState.DELETING
FAILED = CheckpointState.FAILED

# Columns describing one save's result; re-arming clears them so nothing of the previous save
# survives into the new one.
_CLEARED_ON_REARM: dict[str, Any] = {
    "bytes": None,
    "stored_bytes": None,
    "file_count": None,
    "manifest_checksum": None,
    "meta": None,
    **CLEARED_TIMINGS,
    "failure_reason": None,
    "claimed_by": None,
    "claimed_at": None,
    "committed_at": None,
}


def new_save_id() -> str:
    return uuid.uuid4().hex


def committed_by(session: Session, run_id: int, step: int, save_id: str) -> Checkpoint | None:
    """The row if it is already committed by ``save_id`` (a retried or probed commit)."""
    row = load(session, run_id, step)
    if row is not None and row.state == COMMITTED and row.save_id == save_id:
        return row
    return None


def load(session: Session, run_id: int, step: int) -> Checkpoint | None:
    """The row of ``(run, step)`` as it is now (a retry must not see it as first loaded)."""
    statement = select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == step)
    return guarded.reread(session, statement)


def insert(
    session: Session, run: Run, step: int, state: CheckpointState, now: datetime, **values: Any
) -> Checkpoint | None:
    """A new unpinned row of ``(run, step)`` in ``state``, created ``now``; None when a
    concurrent writer inserted the step first (read it again and decide on what it holds)."""
    row = Checkpoint(
        run_id=run.id,
        step=step,
        state=state,
        pinned=False,
        created_at=now,
        updated_at=now,
        **values,
    )
    return guarded.insert(session, row)


def begin(
    session: Session,
    url: str,
    run: Run,
    step: int,
    path: str,
    epoch: int,
    save_id: str | None,
    now: datetime,
) -> tuple[Checkpoint, str, dict[str, Any] | None]:
    """Arm ``(run, step)`` as pending for attempt ``epoch`` under ``save_id`` (or a fresh one).

    Returns ``(row, "begun" | "rearmed", previous)`` where ``previous`` describes the state and
    save that were re-armed (failed, deleted, stale, corrupt, or pending: a crashed save).
    Raises ``CheckpointExistsError`` for a committed step and ``InvalidTransitionError`` for
    one being deleted.
    """
    for _ in range(_BEGIN_RETRIES):
        save = save_id or new_save_id()
        # A new step is the usual case: insert at once (a savepoint), and read the row only
        # when one is there already (an earlier save of the step, or a concurrent begin).
        fresh = insert(session, run, step, PENDING, now, path=path, save_id=save, epoch=epoch)
        if fresh is not None:
            return fresh, "begun", None
        row = load(session, run.id, step)
        if row is None:
            continue  # the row went away in between (deleted with its run): try again
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
        moved = guarded.update_one(
            session,
            Checkpoint,
            guarded.unchanged(Checkpoint, row),
            {
                **_CLEARED_ON_REARM,
                "state": PENDING,
                "save_id": save,
                "epoch": epoch,
                "path": path,
                "created_at": now,
                "updated_at": now,
            },
        )
        if moved is not None:
            return moved, "rearmed", previous
    raise InvalidTransitionError.contended(url, run.name, step, "begin", _BEGIN_RETRIES, "begins")


def _snapshot(row: Checkpoint) -> dict[str, Any]:
    return {
        "state": row.state,
        "save_id": row.save_id,
        "epoch": row.epoch,
        "reason": row.failure_reason,
    }


def _finish_save(
    session: Session,
    url: str,
    run: Run,
    step: int,
    save_id: str,
    target: CheckpointState,
    values: dict[str, Any],
    action: str,
    epoch: int | None = None,
) -> tuple[Checkpoint, bool]:
    guard = [
        Checkpoint.run_id == run.id,
        Checkpoint.step == step,
        Checkpoint.state == PENDING,
        Checkpoint.save_id == save_id,
    ]
    if epoch is not None:
        guard.append(Checkpoint.epoch == epoch)
    moved = guarded.update_one(session, Checkpoint, guard, {**values, "state": target})
    if moved is not None:
        return moved, True
    row = load(session, run.id, step)
    if row is None:
        raise CheckpointRecordNotFoundError(url, run.name, step)
    if row.state == target and row.save_id == save_id:
        # Already done by this save: a retried call, or the marker probe promoted it.
        return row, False
    if row.state == PENDING and row.save_id == save_id:
        raise InvalidTransitionError(
            url,
            run.name,
            step,
            row.state,
            action,
            f"save {save_id} was begun by attempt epoch {row.epoch}, not {epoch}, and only "
            f"that attempt commits it; record a complete checkpoint found on storage with "
            f"upsert_committed instead",
        )
    raise StateConflictError(url, run.name, step, row.state, action, save_id, row.save_id)


def commit(
    session: Session,
    url: str,
    run: Run,
    step: int,
    save_id: str,
    epoch: int,
    facts: dict[str, Any],
    now: datetime,
) -> tuple[Checkpoint, bool]:
    """pending -> committed for this save of attempt ``epoch`` (the one that began it);
    ``(row, moved)``; idempotent for the same save."""
    values = {**facts, "committed_at": now, "updated_at": now, "failure_reason": None}
    return _finish_save(session, url, run, step, save_id, COMMITTED, values, "commit", epoch)


def fail(
    session: Session, url: str, run: Run, step: int, save_id: str, reason: str, now: datetime
) -> tuple[Checkpoint, bool]:
    """pending -> failed for this save; ``(row, moved)``; idempotent for the same save."""
    values = {"failure_reason": reason, "updated_at": now}
    return _finish_save(session, url, run, step, save_id, FAILED, values, "fail")


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
    moved = guarded.update_one(
        session, Checkpoint, conditions, {"pinned": pinned, "updated_at": now}
    )
    if moved is not None:
        return moved, True
    row = load(session, run.id, step)
    if row is None:
        raise CheckpointRecordNotFoundError(url, run.name, step)
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
