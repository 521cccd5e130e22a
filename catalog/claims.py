"""The deletion claim protocol: committed -> deleting -> deleted, safe with many gc processes.

Internal to the catalog: ``Catalog.claim_for_deletion`` opens the write transaction, locks the
run row in share mode (PostgreSQL ``FOR SHARE``; SQLite's ``BEGIN IMMEDIATE`` already excludes
every other writer) and calls ``claim``. In that one transaction:

1. Lock the requested rows that are claimable: ``committed``, or ``deleting`` with a lease
   older than ``lease`` (a gc that crashed or hung). PostgreSQL: ``FOR UPDATE SKIP LOCKED``, so
   concurrent gcs split the work instead of queueing behind each other; a skipped row belongs
   to someone else this round.
2. Re-read the run's committed rows and re-plan with the run's current policy. Only rows the
   fresh plan deletes are claimed; whatever changed since the caller's plan (a new commit, a
   pin, another gc) is taken into account. Missing rows (locked by someone else) can only make
   the fresh plan keep more, never less: a row with fewer than ``num_to_keep`` committed rows
   above it in reality has fewer above it in any subset.
3. Guarded ``UPDATE ... WHERE state = 'committed'`` (or ``deleting`` with an expired lease) sets
   ``deleting`` with this claim's token and time, and returns exactly the rows this caller won.

The claim token (``claimed_by``) identifies the claim; ``mark_deleted`` needs it, so a gc whose
lease was taken over cannot mark a row another gc is finishing. Leases use the claimant's
clock; choose ``lease`` far above clock skew and above the time one checkpoint's storage delete
takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from catalog import queries
from catalog.models import Checkpoint, CheckpointState, Run
from catalog.retention import plan_retention
from catalog.transitions import guarded_update

DEFAULT_LEASE = timedelta(hours=1)

COMMITTED = CheckpointState.COMMITTED
DELETING = CheckpointState.DELETING
DELETED = CheckpointState.DELETED


def claim(
    session: Session,
    run: Run,
    steps: Sequence[int],
    token: str,
    now: datetime,
    lease: timedelta,
) -> list[tuple[Checkpoint, str]]:
    """Claim what may still be deleted among ``steps``; ``[(row, "claimed" | "reclaimed")]``."""
    if not steps:
        return []
    cutoff = now - lease
    claimable = or_(
        Checkpoint.state == COMMITTED,
        and_(Checkpoint.state == DELETING, Checkpoint.claimed_at < cutoff),
    )
    candidates = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.run_id == run.id, Checkpoint.step.in_(sorted(set(steps))), claimable)
        .order_by(Checkpoint.step)
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    ).all()
    if not candidates:
        return []

    committed_now = session.execute(queries.retention_view(run.id, [COMMITTED])).all()
    plan = plan_retention(committed_now, run.num_to_keep, run.keep_every_steps, now, timedelta(0))
    deletable = set(plan.to_delete)

    fresh = [row.id for row in candidates if row.state == COMMITTED and row.step in deletable]
    expired = [row.id for row in candidates if row.state == DELETING]
    values = {"state": DELETING, "claimed_by": token, "claimed_at": now, "updated_at": now}
    won: list[tuple[Checkpoint, str]] = []
    if fresh:
        rows = guarded_update(
            session, [Checkpoint.id.in_(fresh), Checkpoint.state == COMMITTED], values
        )
        won.extend((row, "claimed") for row in rows)
    if expired:
        rows = guarded_update(
            session,
            [
                Checkpoint.id.in_(expired),
                Checkpoint.state == DELETING,
                Checkpoint.claimed_at < cutoff,
            ],
            values,
        )
        won.extend((row, "reclaimed") for row in rows)
    won.sort(key=lambda pair: pair[0].step)
    return won


def finish(session: Session, run: Run, step: int, token: str, now: datetime) -> Checkpoint | None:
    """deleting -> deleted, only for the holder of ``token``; the moved row or None."""
    moved = guarded_update(
        session,
        [
            Checkpoint.run_id == run.id,
            Checkpoint.step == step,
            Checkpoint.state == DELETING,
            Checkpoint.claimed_by == token,
        ],
        {"state": DELETED, "updated_at": now},
    )
    return moved[0] if moved else None


def expired_claims(
    session: Session, run_id: int | None, cutoff: datetime
) -> list[tuple[Checkpoint, str]]:
    """``deleting`` rows whose lease started before ``cutoff``, with their run names."""
    statement = (
        select(Checkpoint, Run.name)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Checkpoint.state == DELETING, Checkpoint.claimed_at < cutoff)
        .order_by(Run.name, Checkpoint.step)
    )
    if run_id is not None:
        statement = statement.where(Checkpoint.run_id == run_id)
    return [(row, name) for row, name in session.execute(statement)]
