"""Run rows: lookup with optional row locks, create/ensure/update, and the one-query summary.

Internal to the catalog: every function runs inside a session opened by ``Catalog``, which
owns the transaction. Run-row locks matter on PostgreSQL only (SQLite serialises writers with
``BEGIN IMMEDIATE``):

- ``lock="share"`` (``FOR SHARE``) is what claims and the fenced save-path calls
  (``begin_checkpoint``, ``mark_committed``) take: many gcs and savers hold it together, and
  the epoch they check cannot change before they commit.
- ``lock="update"`` (``FOR NO KEY UPDATE``) is what changes that can move a row *into* the
  newest ``num_to_keep`` or move the epoch take (a retention change, marking a committed row
  missing or corrupt, the sync repair, registering an attempt); it waits for claims and fenced
  calls in flight, so neither decides on a policy, row set or epoch that is changing. It does
  not conflict with the key-share lock that inserting a checkpoint takes on its run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any, Final, Literal

from sqlalchemy import Select, and_, func, select
from sqlalchemy.orm import Session, aliased

from zephon.catalog import guarded
from zephon.catalog.errors import RunConflictError, RunExistsError, RunNotFoundError
from zephon.catalog.models import Checkpoint, CheckpointState, Run


class _Unset(Enum):
    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset.UNSET
"""Default of optional ``update_run``/``ensure_run`` fields: "leave this field as it is"."""

LockMode = Literal["share", "update"] | None

RUN_FIELDS = ("total_steps", "status", "num_to_keep", "keep_every_steps", "config")


def select_run(name: str, lock: LockMode = None) -> Select[tuple[Run]]:
    statement = select(Run).where(Run.name == name)
    if lock == "share":
        statement = statement.with_for_update(read=True)
    elif lock == "update":
        statement = statement.with_for_update(key_share=True)
    return statement


def find(session: Session, name: str, lock: LockMode = None) -> Run | None:
    return session.scalars(select_run(name, lock)).one_or_none()


def require(session: Session, url: str, name: str, lock: LockMode = None) -> Run:
    run = find(session, name, lock)
    if run is None:
        raise RunNotFoundError(url, name)
    return run


def _same_location(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def _insert(session: Session, name: str, values: dict[str, Any], now: datetime) -> Run | None:
    """Insert a run; ``None`` if a concurrent transaction inserted the same name first."""
    return guarded.insert(session, Run(name=name, created_at=now, updated_at=now, **values))


def create(session: Session, url: str, name: str, values: dict[str, Any], now: datetime) -> Run:
    if find(session, name) is not None:
        raise RunExistsError(url, name)
    run = _insert(session, name, values, now)
    if run is None:
        raise RunExistsError(url, name)
    return run


def ensure(
    session: Session,
    url: str,
    name: str,
    identity: dict[str, str],
    changes: dict[str, Any],
    defaults: dict[str, Any],
    now: datetime,
) -> tuple[Run, bool, dict[str, Any]]:
    """Get or create; returns ``(run, created, changed fields as {field: new value})``.

    ``identity`` (storage_url, kind) must match an existing run; ``changes`` are applied to an
    existing run; a new run gets ``identity | defaults | changes``.
    """
    run = find(session, name, lock="update")
    if run is None:
        run = _insert(session, name, {**identity, **defaults, **changes}, now)
        if run is not None:
            return run, True, {}
        run = require(session, url, name, lock="update")
    if not _same_location(run.storage_url, identity["storage_url"]):
        raise RunConflictError(url, name, "storage_url", run.storage_url, identity["storage_url"])
    if run.kind != identity["kind"]:
        raise RunConflictError(url, name, "kind", run.kind, identity["kind"])
    return run, False, apply_changes(run, changes, now)


def apply_changes(run: Run, changes: dict[str, Any], now: datetime) -> dict[str, Any]:
    changed = {}
    for field, value in changes.items():
        if getattr(run, field) != value:
            setattr(run, field, value)
            changed[field] = value
    if changed:
        run.updated_at = now
    return changed


@dataclass(frozen=True, slots=True)
class SummaryRow:
    run: Run
    committed_count: int
    committed_bytes: int
    latest_step: int | None
    pending_count: int
    last_update: datetime | None
    latest_timings: dict[str, Any] | None = None


def summaries(session: Session, status: str | None = None) -> list[SummaryRow]:
    """Every run with its checkpoint aggregates, in one statement (no query per run)."""
    committed = Checkpoint.state == CheckpointState.COMMITTED
    aggregates = (
        select(
            Checkpoint.run_id,
            func.count().filter(committed).label("committed_count"),
            func.sum(Checkpoint.bytes).filter(committed).label("committed_bytes"),
            func.max(Checkpoint.step).filter(committed).label("latest_step"),
            func.count().filter(Checkpoint.state == CheckpointState.PENDING).label("pending"),
            func.max(Checkpoint.updated_at).label("last_update"),
        )
        .group_by(Checkpoint.run_id)
        .subquery()
    )
    # The latest committed row's timings (``zephon runs`` shows its stall): one more outer
    # join on the unique (run_id, step), still one statement.
    latest = aliased(Checkpoint)
    statement = (
        select(Run, aggregates, latest.timings.label("latest_timings"))
        .outerjoin(aggregates, aggregates.c.run_id == Run.id)
        .outerjoin(latest, and_(latest.run_id == Run.id, latest.step == aggregates.c.latest_step))
        .order_by(Run.name)
    )
    if status is not None:
        statement = statement.where(Run.status == status)
    return [
        SummaryRow(
            run=row.Run,
            committed_count=row.committed_count or 0,
            # PostgreSQL's sum(bigint) is numeric (Decimal in Python).
            committed_bytes=int(row.committed_bytes or 0),
            latest_step=row.latest_step,
            pending_count=row.pending or 0,
            last_update=row.last_update,
            latest_timings=row.latest_timings,
        )
        for row in session.execute(statement)
    ]
