"""The one shape of a ``Catalog`` call: open a transaction, load the run, change it, record an
event, return a record.

``Catalog`` is composed of role views (``catalog/roles/``), each a mixin over ``CatalogBase``.
Every method of theirs that touches the database opens its transaction here, so the steps
they share live in one place:

- ``_transaction(action, write=...)``: a session from ``catalog.engine.Database`` (``write``:
  ``BEGIN IMMEDIATE`` on SQLite), which commits on success, rolls back on any exception and
  turns driver errors into ``CatalogUnavailableError``/``CatalogDatabaseError`` naming
  ``action``. Yields a ``Transaction``, whose ``event`` appends an audit event in the same
  transaction, under this catalog's actor (``catalog.audit``), of the run named ``run``.
- ``_run_transaction(action, run, lock=...)``: the same, with the run row loaded by name
  (``RunNotFoundError`` if missing; ``lock`` as in ``catalog.runs``). Yields a
  ``RunTransaction``, whose events are that run's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from zephon.catalog import runs, validate
from zephon.catalog.audit import default_actor, record_event
from zephon.catalog.engine import Database
from zephon.catalog.models import Run
from zephon.catalog.runs import LockMode

__all__ = ["CatalogBase", "RunTransaction", "Transaction", "call_time", "utc_now"]


def utc_now() -> datetime:
    """The time the catalog stamps on rows and events: aware, in UTC."""
    return datetime.now(UTC)


def call_time(now: datetime | None) -> datetime:
    """The time a call plans or judges leases at: the caller's ``now`` (checked to be aware),
    else the current time."""
    return validate.aware("now", now) if now is not None else utc_now()


class Transaction:
    """One open catalog transaction: its ``session``, and ``event`` for its audit events,
    which name the run ``run_name`` (None: an event of no run)."""

    __slots__ = ("actor", "run_name", "session")

    def __init__(self, session: Session, actor: str, run_name: str | None = None) -> None:
        self.session = session
        self.actor = actor
        self.run_name = run_name

    def event(
        self, action: str, step: int | None = None, detail: dict[str, Any] | None = None
    ) -> None:
        """Append an event (optionally of one ``step``); it commits or rolls back with the
        change it describes."""
        record_event(
            self.session, action, run=self.run_name, step=step, detail=detail, actor=self.actor
        )


class RunTransaction(Transaction):
    """A ``Transaction`` about one run, whose row (``run``) it loaded by name."""

    __slots__ = ("run",)

    def __init__(self, session: Session, actor: str, run: Run) -> None:
        super().__init__(session, actor, run.name)
        self.run = run


class CatalogBase:
    """What every role view of ``Catalog`` stands on: the database, the actor named in
    events, and the transaction helpers of the module docstring."""

    _db: Database
    _actor: str | None

    @property
    def url(self) -> str:
        """The database URL with the password masked."""
        return self._db.url

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._db.dialect

    def _actor_name(self) -> str:
        """The ``actor`` given to ``Catalog``, else ``user@host:pid`` of this process."""
        return self._actor or default_actor()

    @contextlib.contextmanager
    def _transaction(
        self, action: str, *, write: bool = True, run: str | None = None
    ) -> Iterator[Transaction]:
        """A transaction named ``action`` in error messages (``write=False``: a read), whose
        events name the run ``run`` (it is not loaded: it may not exist yet, or any more)."""
        opened = self._db.write(action) if write else self._db.read(action)
        with opened as session:
            yield Transaction(session, self._actor_name(), run)

    @contextlib.contextmanager
    def _run_transaction(
        self, action: str, run: str, *, write: bool = True, lock: LockMode = None
    ) -> Iterator[RunTransaction]:
        """A transaction with the row of the run named ``run`` loaded (and locked, with
        ``lock``); ``RunNotFoundError`` if there is none."""
        with self._transaction(action, write=write) as transaction:
            row = runs.require(transaction.session, self.url, run, lock=lock)
            yield RunTransaction(transaction.session, transaction.actor, row)
