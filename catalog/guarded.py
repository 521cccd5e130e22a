"""The race-safe writes every catalog state machine is built from.

Internal to the catalog. Checkpoints (``catalog.transitions``, ``catalog.repairs``,
``catalog.claims``, ``catalog.attempts``), replicas (``catalog.replicas``) and runs
(``catalog.runs``) all move rows the same way, so that two processes racing on a row never
both win and a lost race never breaks the caller's transaction:

- ``update`` (``update_one`` for one keyed row): one ``UPDATE ... WHERE <guard> RETURNING``;
  the database decides who wins, and the rows returned are exactly those this caller moved.
- ``insert``: an ``INSERT`` inside a savepoint; losing a unique-key race returns None and
  leaves the outer transaction usable (PostgreSQL aborts a transaction on any error).
- ``reread``: a lookup that sees the row as it is now, not as the session first loaded it
  (the re-read after a lost guard or insert).
- ``unchanged``: the guard "the row is still in the state, and of the save, that was read".
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Select
from sqlalchemy import update as sql_update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

Row = TypeVar("Row")


def update(
    session: Session,
    model: type[Row],
    conditions: list[ColumnElement[bool]],
    values: dict[str, Any],
) -> list[Row]:
    """Apply ``values`` to the ``model`` rows matching ``conditions``; the rows actually moved."""
    statement = (
        sql_update(model)
        .where(*conditions)
        .values(**values)
        .returning(model)
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    return list(session.scalars(statement))


def update_one(
    session: Session,
    model: type[Row],
    conditions: list[ColumnElement[bool]],
    values: dict[str, Any],
) -> Row | None:
    """``update`` where ``conditions`` select at most one row (a key among them): that row if
    it moved, else None."""
    moved = update(session, model, conditions, values)
    return moved[0] if moved else None


def insert(session: Session, row: Row) -> Row | None:
    """Insert ``row``; None when a concurrent transaction inserted the same key first (the
    caller reads the row again and decides on what it holds)."""
    try:
        # Savepoint: losing the unique race must not poison the transaction.
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        return None
    return row


def reread(session: Session, statement: Select[tuple[Row]]) -> Row | None:
    """The one row ``statement`` selects (or None), as the database holds it now."""
    return session.scalars(statement.execution_options(populate_existing=True)).one_or_none()


def unchanged(model: Any, row: Any) -> list[ColumnElement[bool]]:
    """The guard "``row`` still has the state and save id it was read with"."""
    return [model.id == row.id, model.state == row.state, model.save_id == row.save_id]
