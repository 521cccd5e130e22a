"""The audit trail: every catalog mutation appends one row to ``events`` in its own transaction.

Writing the event in the same transaction as the change means the log never claims something
that was rolled back, and never misses something that was committed.
"""

from __future__ import annotations

import functools
import getpass
import os
import socket
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, insert
from sqlalchemy.orm import Session

from catalog.models import Event


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
