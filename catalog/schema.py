"""Schema management through Alembic: create an empty catalog at head, refuse one this code
cannot use with the error that says what is true about it, upgrade.

The Alembic configuration is built in code with ``script_location`` set to the installed
``migrations`` package, and the open connection is handed to ``migrations/env.py`` through
``config.attributes``; no ini file and no working directory are involved.

Policy (also in ``docs/catalog.md``):

- A database with neither ``alembic_version`` nor any catalog table is *empty* and is created at
  head on first open (``ensure_schema``), so a new SQLite file just works.
- A database at head whose tables have the models' tables, columns and indexes is used as is.
  ``Catalog(url)`` checks that on every open with one catalog query (``catalog.drift``);
  ``current_revision`` and ``upgrade_schema`` add Alembic's thorough ``compare_metadata``.
- Anything else is refused, and the error's advice is one that works:
  - a known older revision whose tables are that revision's: ``SchemaOutdatedError``, run
    ``zephon db upgrade``; only ``upgrade_schema`` migrates, because migrating is an operator's
    decision (backups, other jobs on older code);
  - tables that differ from the recorded revision: ``SchemaDriftError`` naming each difference,
    with SQL that repairs it when no data was lost, else the SQL recording the revision the
    tables really are, else a backup;
  - catalog tables with no recorded revision: ``SchemaUnversionedError``, with the SQL that
    records the revision they match exactly, if one does;
  - a revision this code does not know: ``SchemaOutdatedError(known=False)``.

Opening a catalog at head never imports Alembic: ``HEAD_REVISION`` (defined in
``catalog.revision``, which loads no SQLAlchemy) names the head revision
(``tests/test_import_cost.py`` fails when a migration is added and the constant is not moved to
it), the revision is read with a plain query (``catalog.drift``), and the tables are compared
with the models' fingerprint. Alembic is imported when the scripts themselves are
needed: creating or upgrading a schema, or explaining one that is not at head.

To tell what an older revision's tables look like, ``revision_fingerprints`` migrates a scratch
in-memory SQLite database through every revision once per process; that costs tens of
milliseconds and happens only for a database that is not at head.

Creation and upgrade run in one transaction under a lock, and re-read the revision after taking
it: on PostgreSQL a transaction-scoped advisory lock, on SQLite ``BEGIN IMMEDIATE`` (the
database write lock). Two processes opening the same empty database therefore serialise, and
the second finds the schema at head instead of failing on "table already exists". Both
backends have transactional DDL, so a failed migration leaves nothing half-created.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Connection, create_engine, text

from zephon import migrations
from zephon.catalog import drift
from zephon.catalog.audit import record_event
from zephon.catalog.drift import Fingerprint
from zephon.catalog.engine import Database
from zephon.catalog.errors import (
    MigrationsNotFoundError,
    SchemaDriftError,
    SchemaError,
    SchemaOutdatedError,
    SchemaUnversionedError,
)
from zephon.catalog.revision import HEAD_REVISION

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory


# Any constant works, as long as every Zephon version uses the same one: it is the key of the
# PostgreSQL advisory lock that serialises schema creation and upgrades in one database.
_SCHEMA_LOCK_KEY = 0x7A65_7068_6F6E_0001  # "zephon" + 1


def alembic_config(script_location: str | None = None) -> Config:
    """An Alembic ``Config`` pointing at the installed ``migrations`` package (or another one).

    ``script_location`` exists for tests that add revisions in a copy of the package.
    """
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", script_location or migrations.LOCATION)
    return config


@functools.lru_cache(maxsize=8)
def _script(script_location: str | None) -> ScriptDirectory:
    # Parsing the revision files costs milliseconds (importing Alembic, a hundred more).
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(script_location))


def head_revision(script_location: str | None = None) -> str:
    """The revision this code's models correspond to: ``HEAD_REVISION`` for the installed
    migrations, else the head of the scripts at ``script_location`` (``scripts_head``)."""
    if script_location is None:
        return HEAD_REVISION
    return scripts_head(script_location)


def scripts_head(script_location: str | None = None) -> str:
    """The head revision of the migration scripts, read with Alembic;
    ``MigrationsNotFoundError`` when there are none (a broken install)."""
    script = _script(script_location)
    head = script.get_current_head()
    if head is None:  # a broken install, or a directory without migrations
        raise MigrationsNotFoundError(script.dir)
    return head


@dataclass(frozen=True, slots=True)
class SchemaState:
    """What a database contains, as far as schema management cares."""

    current: str | None
    has_version_table: bool
    fingerprint: Fingerprint

    @property
    def catalog_tables(self) -> tuple[str, ...]:
        return self.fingerprint.tables

    @property
    def is_empty(self) -> bool:
        return not self.has_version_table and not self.catalog_tables

    @property
    def is_blank(self) -> bool:
        """No catalog table and no recorded revision: ``upgrade_schema`` creates it."""
        return self.current is None and not self.catalog_tables


def read_state(connection: Connection) -> SchemaState:
    """Inspect ``connection``'s database: revision, version table, catalog tables (two
    queries)."""
    fingerprint, version_table = drift.read_structure(connection)
    revisions = drift.read_revisions(connection) if version_table else ()
    return SchemaState(",".join(revisions) or None, version_table, fingerprint)


def _is_known(revision: str | None, script_location: str | None) -> bool:
    if revision is None or (script_location is None and revision == HEAD_REVISION):
        return True
    from alembic.script.revision import ResolutionError
    from alembic.util import CommandError

    script = _script(script_location)
    try:
        return all(script.get_revision(part) is not None for part in revision.split(","))
    except (ResolutionError, CommandError):
        return False


@functools.lru_cache(maxsize=8)
def revision_fingerprints(script_location: str | None = None) -> dict[str, Fingerprint]:
    """The tables, columns and indexes of every revision, oldest first.

    Read from a scratch in-memory SQLite database migrated through the revisions one by one;
    fingerprints hold names only, which are the same on every backend.
    """
    from alembic import command

    script = _script(script_location)
    order = [revision.revision for revision in script.walk_revisions()][::-1]
    engine = create_engine("sqlite://")
    fingerprints: dict[str, Fingerprint] = {}
    try:
        with engine.connect() as connection, connection.begin():
            config = alembic_config(script_location)
            config.attributes["connection"] = connection
            for revision in order:
                command.upgrade(config, revision)
                fingerprints[revision] = drift.read_structure(connection)[0]
    finally:
        engine.dispose()
    return fingerprints


def _expected(revision: str, script_location: str | None) -> Fingerprint:
    if script_location is None and revision == head_revision():
        return drift.model_fingerprint()  # no scratch migration on the hot path
    return revision_fingerprints(script_location)[revision]


def identify(
    fingerprint: Fingerprint, script_location: str | None = None
) -> tuple[str | None, str | None, list[str]]:
    """Which revision these tables are: ``(exact match, None, [])``, or ``(None, closest
    revision, its differences)`` when none matches exactly (or several do)."""
    candidates = revision_fingerprints(script_location)
    exact = [r for r, expected in candidates.items() if not fingerprint.differences(expected)]
    if len(exact) > 1:  # extra indexes are no difference; prefer the revision with exactly these
        exact = [r for r in exact if fingerprint.same_indexes(candidates[r])] or exact
    if len(exact) == 1:
        return exact[0], None, []
    if exact:
        return None, exact[-1], [f"the tables of revisions {', '.join(exact)} look alike"]
    # Newest first, so that a tie goes to the newer revision.
    ranked = sorted(
        reversed(candidates.items()), key=lambda item: len(fingerprint.differences(item[1]))
    )
    closest, expected = ranked[0]
    return None, closest, fingerprint.differences(expected)


def diagnose(
    connection: Connection,
    url: str,
    state: SchemaState,
    script_location: str | None = None,
    *,
    thorough: bool = False,
) -> SchemaError | None:
    """``None`` when the (non-empty) database is at head with the models' tables; otherwise
    the error that says what is true about it and gives advice that works.

    ``thorough`` adds ``compare_metadata`` (types, constraints) when the fingerprint is right.
    """
    head = head_revision(script_location)
    url = str(url)
    if state.current is None:
        if not state.catalog_tables:
            return SchemaOutdatedError(url, None, head, known=True)  # upgrade creates it
        matches, closest, differences = identify(state.fingerprint, script_location)
        return SchemaUnversionedError(
            url,
            list(state.catalog_tables),
            version_table=state.has_version_table,
            head=head,
            matches=matches,
            closest=closest,
            differences=differences,
        )
    if not _is_known(state.current, script_location):
        return SchemaOutdatedError(url, state.current, head, known=False)
    differences = state.fingerprint.differences(_expected(state.current, script_location))
    if not differences and thorough and state.current == head and script_location is None:
        differences = drift.model_differences(connection)
    if differences:
        repair = drift.repair_sql(differences, connection)
        matches = None
        if not repair:
            matches, _, _ = identify(state.fingerprint, script_location)
        return SchemaDriftError(
            url,
            state.current,
            head,
            differences,
            repair_sql=repair,
            matches=matches if matches != state.current else None,
        )
    if state.current != head:
        return SchemaOutdatedError(url, state.current, head, known=True)
    return None


def _behind(error: SchemaError | None) -> bool:
    """A known older revision with that revision's tables: upgrading works."""
    return isinstance(error, SchemaOutdatedError) and error.known


def _lock(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
    # SQLite: the caller's BEGIN IMMEDIATE already holds the database's write lock.


def _migrate(connection: Connection, target: str, script_location: str | None) -> None:
    from alembic import command

    scripts_head(script_location)  # MigrationsNotFoundError for a broken install
    config = alembic_config(script_location)
    config.attributes["connection"] = connection
    command.upgrade(config, target)


def ensure_schema(db: Database, script_location: str | None = None) -> None:
    """Create an empty database at head; return if at head with the models' tables; otherwise
    raise the ``SchemaError`` that says why not.

    Called by ``Catalog(url)``, so it is cheap at head: two queries (structure and revision)
    and a set comparison. Safe to run from many processes at once.
    """
    with db.read("check the schema") as session:
        connection = session.connection()
        state = read_state(connection)
        if not state.is_empty:
            error = diagnose(connection, db.url, state, script_location)
            if error is None:
                return
            raise error
    with db.immediate_connection("create the schema") as connection:
        _lock(connection)
        state = read_state(connection)
        if not state.is_empty:  # another process created it while we waited for the lock
            error = diagnose(connection, db.url, state, script_location)
            if error is None:
                return
            raise error
        head = head_revision(script_location)
        _migrate(connection, head, script_location)
        record_event(connection, "schema_created", detail={"revision": head})


def check_schema(db: Database, script_location: str | None = None) -> None:
    """Return if the database is at head with the models' tables, else raise the
    ``SchemaError`` that says why; never creates or migrates anything (a read-only
    ``Catalog``: an empty database is refused as a schema with no revision, whose fix,
    ``zephon db upgrade``, is for someone allowed to write)."""
    with db.read("check the schema") as session:
        connection = session.connection()
        state = read_state(connection)
        if state.is_empty:
            raise SchemaOutdatedError(db.url, None, head_revision(script_location), known=True)
        error = diagnose(connection, db.url, state, script_location)
        if error is not None:
            raise error


def current_revision(db: Database, script_location: str | None = None) -> str | None:
    """The database's revision, verified: ``None`` when no catalog was created yet, the
    revision when its tables are that revision's (at head, also by ``compare_metadata``);
    otherwise the ``SchemaError`` that ``Catalog(url)`` or ``zephon db upgrade`` would meet
    (drift, no recorded revision, a revision this code does not know)."""
    with db.read("read the schema revision") as session:
        connection = session.connection()
        state = read_state(connection)
        if state.is_empty or state.is_blank:
            return None
        error = diagnose(connection, db.url, state, script_location, thorough=True)
        if error is None or _behind(error):
            return state.current
        raise error


def upgrade_schema(db: Database, script_location: str | None = None) -> tuple[str | None, str]:
    """Migrate the database to head; returns ``(revision before, revision after)``.

    The ``zephon db upgrade`` command. Idempotent. Migrates only an empty database or a known
    older revision whose tables are that revision's; everything else (drift, no recorded
    revision, a newer Zephon's revision) is refused with the error ``diagnose`` gives, since
    migrating there would fail halfway or guess.
    """
    head = head_revision(script_location)
    with db.immediate_connection("upgrade the schema") as connection:
        _lock(connection)
        state = read_state(connection)
        if not state.is_empty and not state.is_blank:
            error = diagnose(connection, db.url, state, script_location, thorough=True)
            if error is None:
                return head, head
            if not _behind(error):
                raise error
        _migrate(connection, head, script_location)
        action = "schema_created" if state.is_blank else "schema_upgraded"
        record_event(connection, action, detail={"from": state.current, "to": head})
        return state.current, head
