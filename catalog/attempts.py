"""Attempts and fencing: registering a new start of a job, and refusing calls from older ones.

Internal to the catalog: every function runs inside a session opened by ``Catalog``.

An *attempt* is one start of a job for a run, identified by its *epoch*: a per-run, monotonic
fencing token that storage hands out (create-only objects ``<run>/_attempts/<epoch>.json``).
The catalog mirrors the attempts and enforces the epoch transactionally:

- ``register`` holds the run row's ``update`` lock (PostgreSQL ``FOR NO KEY UPDATE``), refuses
  an epoch that is not above ``runs.epoch``, inserts the ``attempts`` row, moves ``runs.epoch``
  and, in the same transaction, moves every row of an older attempt above the resume point to
  ``stale``: that history was abandoned by the new attempt.
- ``check_current`` is the fence. Its callers hold the run row's ``share`` lock (``FOR
  SHARE``) and are refused unless their epoch is ``runs.epoch``. Share and update locks
  conflict, so a fenced change and a registration never interleave: either the fenced change
  commits first and the registration then sees (and stales) what it wrote, or the registration
  commits first and the fenced call, reading the run row after it, is refused. Checking in a
  separate, earlier transaction would leave a window in which an old attempt commits above
  the new resume point. On SQLite ``BEGIN IMMEDIATE`` serialises all writers, which gives the
  same guarantee.
- ``abandoning`` is the lineage rule, shared by registration and the sync repair: a checkpoint
  of epoch ``e`` at step ``s`` is abandoned if an attempt with an epoch above ``e`` resumed
  from a step below ``s``, or started fresh.

Epoch 0 means "unfenced": a run whose ``epoch`` is 0 never had a registered attempt, and only
then do calls with epoch 0 pass the fence.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from zephon.catalog import guarded
from zephon.catalog.errors import FencedOutError, InvalidValueError
from zephon.catalog.models import Attempt, Checkpoint, CheckpointState, Run
from zephon.catalog.records import AttemptRecord
from zephon.catalog.retention import ResumePoint

# States a newer attempt abandons. Deleting/deleted rows are gc's; corrupt and stale ones are
# already out of every lineage.
ABANDONABLE = (CheckpointState.PENDING, CheckpointState.COMMITTED, CheckpointState.FAILED)


#: ``resume_point``'s ``attempt`` when the caller has not loaded it
_LOAD = object()


def load(session: Session, run_id: int, epoch: int) -> Attempt | None:
    statement = select(Attempt).where(Attempt.run_id == run_id, Attempt.epoch == epoch)
    return session.scalars(statement).one_or_none()


def current(session: Session, run: Run) -> Attempt | None:
    """The run's current attempt (the row of ``runs.epoch``); None for an unfenced run."""
    return None if run.epoch == 0 else load(session, run.id, run.epoch)


def current_record(session: Session, run: Run) -> AttemptRecord | None:
    row = current(session, run)
    return None if row is None else AttemptRecord.of(row, run.name)


def all_of(session: Session, run: Run) -> list[Attempt]:
    """The run's attempts, ascending epoch."""
    statement = select(Attempt).where(Attempt.run_id == run.id).order_by(Attempt.epoch)
    return list(session.scalars(statement))


def check_current(session: Session, url: str, run: Run, epoch: int) -> None:
    """The fence: raise ``FencedOutError`` unless ``epoch`` is the run's current epoch.

    The caller must hold the run row's ``share`` (or ``update``) lock, taken when it read
    ``run``, and make its change in the same transaction; see the module docstring.
    """
    if run.epoch != epoch:
        raise FencedOutError(url, run.name, epoch, current_record(session, run))


def abandonment_reason(epoch: int, resumed_from: int | None) -> str:
    if resumed_from is None:
        return f"abandoned: attempt epoch {epoch} started fresh"
    return f"abandoned: attempt epoch {epoch} resumed from step {resumed_from}"


def register(
    session: Session, url: str, run: Run, values: dict[str, Any], now: datetime
) -> tuple[Attempt, list[int], bool]:
    """Make the attempt described by ``values`` the run's current one; with a
    ``resumed_from`` in ``values`` it is decided at once (``decide``), without one it is
    registered undecided (it fences older attempts and abandons nothing yet).

    Returns ``(attempt, abandoned steps ascending, registered)``; ``registered`` is False when
    the same attempt (same epoch and attempt id) was already current: a retried call, which
    changes nothing. The caller holds the run row's ``update`` lock. Raises
    ``FencedOutError`` for an epoch not above the current one.
    """
    epoch = values["epoch"]
    existing = current(session, run)
    if existing is not None and (existing.epoch, existing.attempt_id) == (
        epoch,
        values["attempt_id"],
    ):
        return existing, [], False
    if epoch <= run.epoch:
        raise FencedOutError(url, run.name, epoch, current_record(session, run))
    decided = "resumed_from" in values
    attempt = Attempt(
        run_id=run.id,
        registered_at=now,
        decided_at=now if decided else None,
        **{"resumed_from": None, **values},
    )
    session.add(attempt)
    run.epoch = epoch
    run.updated_at = now
    session.flush()
    abandoned = _abandon(session, run, epoch, values["resumed_from"], now) if decided else []
    return attempt, abandoned, True


def decide(
    session: Session, url: str, run: Run, epoch: int, resumed_from: int | None, now: datetime
) -> tuple[Attempt, list[int], bool]:
    """The current attempt ``epoch`` resumes from ``resumed_from``: record it and, in the same
    transaction, abandon every older attempt's row above it. ``(attempt, abandoned, changed)``;
    deciding the same again changes nothing. The caller holds the run row's ``update`` lock;
    a stale ``epoch`` raises ``FencedOutError``, another decision ``InvalidValueError``."""
    check_current(session, url, run, epoch)
    attempt = current(session, run)
    assert attempt is not None
    if attempt.decided_at is not None:
        if attempt.resumed_from != resumed_from:
            raise InvalidValueError(
                "resumed_from",
                resumed_from,
                f"attempt epoch {epoch} of run {run.name!r} already resumed from "
                f"{attempt.resumed_from}; a new resume point needs a new attempt",
            )
        return attempt, [], False
    attempt.resumed_from = resumed_from
    attempt.decided_at = now
    session.flush()
    return attempt, _abandon(session, run, epoch, resumed_from, now), True


def _abandon(
    session: Session, run: Run, epoch: int, resumed_from: int | None, now: datetime
) -> list[int]:
    """Older attempts' rows above ``resumed_from`` (every step if None) -> stale.

    ``resumed_from`` itself stays: it is the new attempt's starting point.
    """
    conditions = [
        Checkpoint.run_id == run.id,
        Checkpoint.epoch < epoch,
        Checkpoint.state.in_(ABANDONABLE),
    ]
    if resumed_from is not None:
        conditions.append(Checkpoint.step > resumed_from)
    values = {
        "state": CheckpointState.STALE,
        "failure_reason": abandonment_reason(epoch, resumed_from),
        "updated_at": now,
    }
    return sorted(row.step for row in guarded.update(session, Checkpoint, conditions, values))


def abandoning(session: Session, run_id: int, epoch: int, step: int) -> Attempt | None:
    """The first attempt that abandoned a checkpoint of ``epoch`` at ``step``, or None."""
    statement = (
        select(Attempt)
        .where(
            Attempt.run_id == run_id,
            Attempt.epoch > epoch,
            Attempt.decided_at.is_not(None),
            or_(Attempt.resumed_from.is_(None), Attempt.resumed_from < step),
        )
        .order_by(Attempt.epoch)
        .limit(1)
    )
    return session.scalars(statement).first()


def resume_point(
    session: Session, run: Run, attempt: Attempt | None | object = _LOAD
) -> ResumePoint | None:
    """The step the current attempt resumed from, which retention must keep while it is the
    attempt's only footing: until the attempt commits a checkpoint of its own above it (from
    then on the lineage continues from that one, and the policy decides as usual).
    ``attempt``: the current attempt's row when the caller loaded it already."""
    if attempt is _LOAD:
        attempt = current(session, run)
    if attempt is None or attempt.resumed_from is None or attempt.decided_at is None:
        return None
    own_newer = session.scalars(
        select(Checkpoint.id)
        .where(
            Checkpoint.run_id == run.id,
            Checkpoint.epoch == attempt.epoch,
            Checkpoint.state == CheckpointState.COMMITTED,
            Checkpoint.step > attempt.resumed_from,
        )
        .limit(1)
    ).first()
    if own_newer is not None:
        return None
    return ResumePoint(step=attempt.resumed_from, epoch=attempt.epoch)
