"""The audit trail: every catalog mutation appends one row to ``events`` in its own transaction.

Writing the event in the same transaction as the change means the log never claims something
that was rolled back, and never misses something that was committed.

Retention of the log is ``delete_before``: one bounded batch of the oldest events per call,
so that pruning a huge table is many short transactions (other writers interleave between
them) rather than one that holds SQLite's write lock, or PostgreSQL's row locks and WAL, for
minutes.
"""

from __future__ import annotations

import functools
import getpass
import os
import socket
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Delete, any_, delete, func, insert, select
from sqlalchemy.orm import Session

from zephon.catalog.models import Event


@functools.cache
def _user_and_host() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        # Containers often run as a uid without a passwd entry.
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def default_actor() -> str:
    """``user@host:pid`` of the calling process; the pid is read per call, as forks change it."""
    return f"{_user_and_host()}:{os.getpid()}"


def record_event(
    executor: Session | Connection,
    action: str,
    *,
    run: str | None = None,
    step: int | None = None,
    detail: dict[str, Any] | None = None,
    actor: str | None = None,
    at: datetime | None = None,
) -> None:
    """Append one event inside the caller's transaction (a Session or a Core Connection)."""
    executor.execute(
        insert(Event).values(
            at=at or datetime.now(UTC),
            actor=actor or default_actor(),
            action=action,
            run_name=run,
            step=step,
            detail=detail,
        )
    )


def with_previous(detail: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """An event's ``detail``, plus ``previous`` (what a re-armed row was) when there was one."""
    return detail if previous is None else {**detail, "previous": previous}


def delete_batch(cutoff: datetime, limit: int, dialect: str) -> Delete:
    """``DELETE`` of up to ``limit`` of the oldest events with ``at < cutoff``.

    The ids come from an ordered, limited range scan of ``ix_events_at``, so a batch reads
    about what it deletes, however many events the table holds beyond the cut-off. On
    PostgreSQL the ids are handed over as an array (``id = ANY(ARRAY(...))``): with ``IN
    (subquery)`` the planner may hash-join them against a sequential scan of the whole table;
    an array makes it look each one up in the primary key. SQLite does those lookups anyway.
    """
    batch = select(Event.id).where(Event.at < cutoff).order_by(Event.at).limit(limit)
    if dialect == "postgresql":
        return delete(Event).where(Event.id == any_(func.array(batch.scalar_subquery())))
    return delete(Event).where(Event.id.in_(batch.scalar_subquery()))


def delete_before(executor: Session | Connection, cutoff: datetime, limit: int) -> int:
    """Run one ``delete_batch``; returns how many events it deleted."""
    statement = delete_batch(cutoff, limit, executor.get_bind().dialect.name)
    result = executor.execute(statement, execution_options={"synchronize_session": False})
    return int(result.rowcount)  # type: ignore[attr-defined]
