"""Schema management through Alembic: create an empty catalog at head, refuse a stale one, upgrade.

The Alembic configuration is built in code with ``script_location`` set to the installed
``migrations`` package, and the open connection is handed to ``migrations/env.py`` through
``config.attributes``; no ini file and no working directory are involved.

Policy (also in ``docs/catalog.md``):

- A database with neither ``alembic_version`` nor any catalog table is *empty* and is created at
  head on first open (``ensure_schema``), so a new SQLite file just works.
- A database at head is used as is; anything else is refused: behind or unknown revision with
  ``SchemaOutdatedError``, catalog tables without ``alembic_version`` with
  ``SchemaUnversionedError``. Only ``upgrade_schema`` (``zephon db upgrade``) migrates, because
  migrating is an operator's decision (backups, other jobs on older code).

Creation and upgrade run in one transaction under a lock, and re-read the revision after taking
it: on PostgreSQL a transaction-scoped advisory lock, on SQLite ``BEGIN IMMEDIATE`` (the
database write lock). Two processes opening the same empty database therefore serialise, and
the second finds the schema at head instead of failing on "table already exists". Both
backends have transactional DDL, so a failed migration leaves nothing half-created.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import ResolutionError
from alembic.util import CommandError
from sqlalchemy import Connection, inspect, text

import migrations
from catalog.audit import record_event
from catalog.engine import Database
from catalog.errors import SchemaOutdatedError, SchemaUnversionedError
from catalog.models import CATALOG_TABLES

# Any constant works, as long as every Zephon version uses the same one: it is the key of the
# PostgreSQL advisory lock that serialises schema creation and upgrades in one database.
_SCHEMA_LOCK_KEY = 0x7A65_7068_6F6E_0001  # "zephon" + 1


def alembic_config(script_location: str | None = None) -> Config:
    """An Alembic ``Config`` pointing at the installed ``migrations`` package (or another one).

    ``script_location`` exists for tests that add revisions in a copy of the package.
    """
    config = Config()
    config.set_main_option("script_location", script_location or migrations.LOCATION)
    return config


@functools.lru_cache(maxsize=8)
def _script(script_location: str | None) -> ScriptDirectory:
    # Parsing the revision files costs milliseconds; every Catalog(url) needs the head.
    return ScriptDirectory.from_config(alembic_config(script_location))


def head_revision(script_location: str | None = None) -> str:
    """The revision this code's models correspond to."""
    script = _script(script_location)
    head = script.get_current_head()
    if head is None:  # pragma: no cover - only if the migrations package is broken
        raise RuntimeError(f"no Alembic revisions in {script.dir}")
    return head


@dataclass(frozen=True, slots=True)
class SchemaState:
    """What a database contains, as far as schema management cares."""

    current: str | None
    has_version_table: bool
    catalog_tables: tuple[str, ...]

    @property
    def is_empty(self) -> bool:
        return not self.has_version_table and not self.catalog_tables


def read_state(connection: Connection) -> SchemaState:
    """Inspect ``connection``'s database: revision, version table, catalog tables present."""
    inspector = inspect(connection)
    tables = set(inspector.get_table_names())
    heads = MigrationContext.configure(connection).get_current_heads()
    return SchemaState(
        current=",".join(heads) if heads else None,
        has_version_table="alembic_version" in tables,
        catalog_tables=tuple(name for name in CATALOG_TABLES if name in tables),
    )


def _is_known(revision: str | None, script_location: str | None) -> bool:
    if revision is None:
        return True
    script = _script(script_location)
    try:
        return all(script.get_revision(part) is not None for part in revision.split(","))
    except (ResolutionError, CommandError):
        return False


def _refusal(url: str, state: SchemaState, head: str, script_location: str | None) -> Exception:
    if not state.has_version_table:
        return SchemaUnversionedError(url, list(state.catalog_tables))
    return SchemaOutdatedError(
        url, state.current, head, known=_is_known(state.current, script_location)
    )


def _lock(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
    # SQLite: the caller's BEGIN IMMEDIATE already holds the database's write lock.


def _migrate(connection: Connection, target: str, script_location: str | None) -> None:
    config = alembic_config(script_location)
    config.attributes["connection"] = connection
    command.upgrade(config, target)


def ensure_schema(db: Database, script_location: str | None = None) -> None:
    """Create an empty database at head; return if at head; otherwise raise a ``SchemaError``.

    Called by ``Catalog(url)``. Safe to run from many processes at once.
    """
    head = head_revision(script_location)
    with db.read("check the schema") as session:
        state = read_state(session.connection())
    if state.current == head:
        return
    if not state.is_empty:
        raise _refusal(db.url, state, head, script_location)
    with db.immediate_connection("create the schema") as connection:
        _lock(connection)
        state = read_state(connection)
        if state.current == head:
            return  # another process created it while we waited for the lock
        if not state.is_empty:
            raise _refusal(db.url, state, head, script_location)
        _migrate(connection, head, script_location)
        record_event(connection, "schema_created", detail={"revision": head})


def current_revision(db: Database) -> str | None:
    """The database's revision (``None`` when it has no ``alembic_version`` row)."""
    with db.read("read the schema revision") as session:
        return read_state(session.connection()).current


def upgrade_schema(db: Database, script_location: str | None = None) -> tuple[str | None, str]:
    """Migrate the database to head; returns ``(revision before, revision after)``.

    The ``zephon db upgrade`` command. Idempotent; refuses unversioned catalog tables and
    revisions this code does not know (a newer Zephon's), since guessing there loses data.
    """
    head = head_revision(script_location)
    with db.immediate_connection("upgrade the schema") as connection:
        _lock(connection)
        state = read_state(connection)
        if state.current == head:
            return head, head
        if not state.has_version_table and state.catalog_tables:
            raise SchemaUnversionedError(db.url, list(state.catalog_tables))
        if not _is_known(state.current, script_location):
            raise SchemaOutdatedError(db.url, state.current, head, known=False)
        _migrate(connection, head, script_location)
        action = "schema_created" if state.is_empty else "schema_upgraded"
        record_event(connection, action, detail={"from": state.current, "to": head})
        return state.current, head
