"""The deletion claim protocol: -> deleting -> deleted, safe with many gc processes and jobs.

Internal to the catalog: ``Catalog.claim_for_deletion`` opens the write transaction, locks the
run row in share mode (PostgreSQL ``FOR SHARE``; SQLite's ``BEGIN IMMEDIATE`` already excludes
every other writer), applies the attempt fence when the caller is a job's own retention, and
calls ``claim``. In that one transaction:

1. Lock the requested rows that are claimable: ``committed`` and ``stale`` (and ``corrupt``
   when asked), or ``deleting`` with a lease older than ``lease`` (a gc that crashed or hung).
   PostgreSQL: ``FOR UPDATE SKIP LOCKED``, so concurrent gcs split the work instead of queueing
   behind each other; a skipped row belongs to someone else this round.
2. Re-plan with ``current_plan``: the very function, rows, policy, resume point and grace that
   ``Catalog.retention_plan`` uses, read now. Only rows the fresh plan deletes are claimed;
   whatever changed since the caller's plan (a new commit, a pin, a new attempt and its resume
   point, another gc) is taken into account. The plan reads every row, locked or not, so rows
   skipped in step 1 change nothing about what the others may do.
3. Guarded ``UPDATE ... WHERE state IN (<claimable>)`` (or ``deleting`` with an expired lease)
   sets ``deleting`` with this claim's token and time, and returns exactly the rows this
   caller won.

The claim token (``claimed_by``) identifies the claim; ``mark_deleted`` needs it, so a gc whose
lease was taken over cannot mark a row another gc is finishing. Leases use the claimant's
clock; choose ``lease`` far above clock skew and above the time one checkpoint's storage delete
takes.

A claim whose storage delete failed is given back with ``release``: the row stays ``deleting``
(its marker may be gone already, so it is no checkpoint any more) with ``claimed_at`` cleared,
which every lease treats as expired, so the next gc re-claims and finishes it at once. gc also
releases the claims of a holder it proved dead (``zephon.holders``). ``claim_holder`` reads the
host and pid a default claim token names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, or_, select
from sqlalchemy.orm import Session

from zephon.catalog import attempts, guarded, queries, replicas
from zephon.catalog.models import Checkpoint, CheckpointState, Run
from zephon.catalog.records import AttemptRecord
from zephon.catalog.retention import DEFAULT_GRACE, RetentionPlan, plan_retention

DEFAULT_LEASE = timedelta(hours=1)

COMMITTED = CheckpointState.COMMITTED
DELETING = CheckpointState.DELETING
DELETED = CheckpointState.DELETED
STALE = CheckpointState.STALE
CORRUPT = CheckpointState.CORRUPT

# The states retention plans over, and ``deleting`` (claimed by a gc), which a plan does not
# decide but notes in ``RetentionPlan.held``: the same read tells gc whether any claim is held;
# the others are final.
PLANNED = [COMMITTED, CheckpointState.PENDING, STALE, CORRUPT, DELETING]

# "<user>@<host>:<pid>/<12 hex>": a claim token made with the default actor (catalog.audit)
_DEFAULT_TOKEN = re.compile(r"[^@/]*@(?P<host>[^:/@]+):(?P<pid>[0-9]{1,10})/[0-9a-f]{12}")


def claim_holder(token: str) -> tuple[str, int] | None:
    """``(host, pid)`` of the process that made claim ``token`` with the default actor
    ``user@host:pid``; None for a token of another actor (``Catalog(actor=...)``), whose
    process cannot be told."""
    found = _DEFAULT_TOKEN.fullmatch(token)
    return (found["host"], int(found["pid"])) if found else None


def _lease_over(cutoff: datetime) -> ColumnElement[bool]:
    """A ``deleting`` row anyone may re-claim: its lease began before ``cutoff``, or its holder
    released it (``claimed_at`` cleared)."""
    return and_(
        Checkpoint.state == DELETING,
        or_(Checkpoint.claimed_at.is_(None), Checkpoint.claimed_at < cutoff),
    )


def current_plan(
    session: Session,
    run: Run,
    now: datetime,
    *,
    grace: timedelta,
    pending_grace: timedelta = DEFAULT_GRACE,
    corrupt: bool = False,
) -> RetentionPlan:
    """The run's retention plan from its rows, policy and current resume point, as of now.

    The one place a plan is made from the database: ``Catalog.retention_plan`` shows it and
    ``claim`` re-makes it inside the claim's transaction.
    """
    rows = session.execute(queries.retention_view(run.id, PLANNED)).all()
    attempt = attempts.current(session, run)
    plan = plan_retention(
        rows,
        run.num_to_keep,
        run.keep_every_steps,
        now,
        grace,
        pending_grace=pending_grace,
        corrupt=corrupt,
        resume_point=attempts.resume_point(session, run, attempt),
    )
    record = None if attempt is None else AttemptRecord.of(attempt, run.name)
    return dataclasses.replace(plan, current=record)


def claim(
    session: Session,
    run: Run,
    steps: Sequence[int],
    token: str,
    now: datetime,
    lease: timedelta,
    *,
    grace: timedelta,
    corrupt: bool,
    requested: bool = False,
) -> list[tuple[Checkpoint, str, str]]:
    """Claim what may still be deleted among ``steps``: what the retention plan deletes now,
    or with ``requested`` (a framework's own retention asking for these steps) every one of
    them but pinned rows and the current attempt's resume point.

    Returns ``[(row, "claimed" | "reclaimed", state it was in)]`` in step order.
    """
    if not steps:
        return []
    cutoff = now - lease
    deletable_states = [COMMITTED, STALE, *([CORRUPT] if corrupt else [])]
    claimable = or_(Checkpoint.state.in_(deletable_states), _lease_over(cutoff))
    candidates = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.run_id == run.id, Checkpoint.step.in_(sorted(set(steps))), claimable)
        .order_by(Checkpoint.step)
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    ).all()
    if not candidates:
        return []
    was = {row.id: str(row.state) for row in candidates}

    if requested:
        footing = attempts.resume_point(session, run)
        deletable = {
            row.step
            for row in candidates
            if not row.pinned and (footing is None or row.step != footing.step)
        }
    else:
        deletable = set(current_plan(session, run, now, grace=grace, corrupt=corrupt).to_delete)
    fresh = [row.id for row in candidates if row.state != DELETING and row.step in deletable]
    expired = [row.id for row in candidates if row.state == DELETING]
    values = {"state": DELETING, "claimed_by": token, "claimed_at": now, "updated_at": now}
    won: list[tuple[Checkpoint, str, str]] = []
    if fresh:
        rows = guarded.update(
            session,
            Checkpoint,
            [Checkpoint.id.in_(fresh), Checkpoint.state.in_(deletable_states)],
            values,
        )
        won.extend((row, "claimed", was[row.id]) for row in rows)
    if expired:
        rows = guarded.update(
            session,
            Checkpoint,
            [Checkpoint.id.in_(expired), _lease_over(cutoff)],
            values,
        )
        won.extend((row, "reclaimed", was[row.id]) for row in rows)
    won.sort(key=lambda entry: entry[0].step)
    return won


def finish(session: Session, run: Run, step: int, token: str, now: datetime) -> Checkpoint | None:
    """deleting -> deleted, only for the holder of ``token``; the moved row or None. The
    step's committed ``save_dir`` replica goes with it (``replicas.save_dir_copy_gone``)."""
    row = guarded.update_one(
        session,
        Checkpoint,
        [
            Checkpoint.run_id == run.id,
            Checkpoint.step == step,
            Checkpoint.state == DELETING,
            Checkpoint.claimed_by == token,
        ],
        {"state": DELETED, "updated_at": now},
    )
    if row is not None:
        replicas.save_dir_copy_gone(session, run.id, step, now)
    return row


def release(session: Session, run: Run, tokens: Sequence[str], now: datetime) -> list[Checkpoint]:
    """End the leases of the run's ``deleting`` rows held by ``tokens`` now: they stay
    ``deleting`` and the next claim takes them over whatever its lease; the rows released."""
    return guarded.update(
        session,
        Checkpoint,
        [
            Checkpoint.run_id == run.id,
            Checkpoint.state == DELETING,
            Checkpoint.claimed_by.in_(sorted(set(tokens))),
            Checkpoint.claimed_at.is_not(None),
        ],
        {"claimed_at": None, "updated_at": now},
    )


def expired_claims(
    session: Session, run_id: int | None, cutoff: datetime
) -> list[tuple[Checkpoint, str]]:
    """``deleting`` rows whose lease started before ``cutoff`` or was released, with their run
    names."""
    statement = (
        select(Checkpoint, Run.name)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(_lease_over(cutoff))
        .order_by(Run.name, Checkpoint.step)
    )
    if run_id is not None:
        statement = statement.where(Checkpoint.run_id == run_id)
    return [(row, name) for row, name in session.execute(statement)]
