"""Schema drift: a database whose tables are not what its recorded revision says is refused by
``Catalog(url)``, ``current_revision`` and ``upgrade`` alike, with an error naming each
difference and advice that works; every SQL fix an error offers is executed here and must
make the catalog usable. On SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, event, text

from tests.catalog.conftest import execute_sql, migrate
from zephon import catalog
from zephon.catalog import (
    Catalog,
    SchemaDriftError,
    SchemaOutdatedError,
    SchemaUnversionedError,
    drift,
    schema,
)
from zephon.catalog.engine import Database

INITIAL = "a1bd075f368c"
EPOCHS = "fbbf4a6c29ae"
EVENTS_AT = "3a0e83d9015e"
HEAD = catalog.head_revision()


def _refusals(url: str, error: type[Exception]) -> list[Exception]:
    """The error each of the three entry points raises; they must agree."""
    found = []
    for attempt in (
        lambda: Catalog(url),
        lambda: catalog.current_revision(url),
        lambda: catalog.upgrade(url),
    ):
        with pytest.raises(error) as caught:
            attempt()
        found.append(caught.value)
    return found


def _drop_column(url: str, table: str, column: str) -> None:
    execute_sql(url, f"ALTER TABLE {table} DROP COLUMN {column}")


def _works(url: str) -> None:
    with Catalog(url) as opened:
        opened.ensure_run("r", "/c/r")
        assert opened.current_revision() == HEAD
    assert catalog.upgrade(url) == (HEAD, HEAD)


def test_a_column_dropped_by_hand_is_named_and_upgrade_is_not_the_advice(catalog_url):
    Catalog(catalog_url).close()
    _drop_column(catalog_url, "checkpoints", "file_count")
    for error in _refusals(catalog_url, SchemaDriftError):
        assert error.differences == ("missing column checkpoints.file_count",)
        assert (error.revision, error.head, error.fix_sql, error.matches) == (HEAD, HEAD, (), None)
        message = str(error)
        assert f"records schema revision {HEAD}" in message
        assert "missing column checkpoints.file_count" in message
        assert "zephon db upgrade cannot repair this: restore the database from a backup" in message
        assert "zephon sync <storage URL>" in message


def test_a_table_dropped_by_hand_is_named(catalog_url):
    Catalog(catalog_url).close()
    execute_sql(catalog_url, "DROP TABLE attempts")
    for error in _refusals(catalog_url, SchemaDriftError):
        assert error.differences == ("missing table attempts",)
        assert error.fix_sql == ()


def test_a_dropped_replicas_table_or_timings_column_is_named(catalog_url):
    Catalog(catalog_url).close()
    execute_sql(catalog_url, "DROP TABLE checkpoint_replicas")
    for error in _refusals(catalog_url, SchemaDriftError):
        assert error.differences == ("missing table checkpoint_replicas",)
    # and what the stall column's and the stored bytes' revisions added after them
    _drop_column(catalog_url, "checkpoints", "stored_bytes")
    execute_sql(catalog_url, "DROP INDEX ix_checkpoints_attempt_saves")
    _drop_column(catalog_url, "checkpoints", "stall_s")
    _drop_column(catalog_url, "checkpoints", "timings")
    # Without both, the tables are exactly the previous revision's: record it, then upgrade.
    error = _refusals(catalog_url, SchemaDriftError)[0]
    assert error.matches == EVENTS_AT
    assert error.fix_sql == (f"UPDATE alembic_version SET version_num = '{EVENTS_AT}'",)
    assert "zephon db upgrade" in str(error)
    execute_sql(catalog_url, *error.fix_sql)
    assert catalog.upgrade(catalog_url) == (EVENTS_AT, HEAD)
    _works(catalog_url)


def test_a_missing_index_comes_with_the_create_index_that_repairs_it(catalog_url):
    Catalog(catalog_url).close()
    execute_sql(catalog_url, "DROP INDEX ix_events_at")
    errors = _refusals(catalog_url, SchemaDriftError)
    for error in errors:
        assert error.differences == ("missing index ix_events_at on events",)
        assert error.fix_sql == ("CREATE INDEX ix_events_at ON events (at)",)
        assert "repair it with the SQL `CREATE INDEX ix_events_at ON events (at)`" in str(error)
    execute_sql(catalog_url, *errors[0].fix_sql)
    _works(catalog_url)


def test_a_column_added_by_hand_comes_with_the_drop_column_that_repairs_it(catalog_url):
    Catalog(catalog_url).close()
    execute_sql(catalog_url, "ALTER TABLE runs ADD COLUMN note VARCHAR(10) NOT NULL DEFAULT 'x'")
    error = _refusals(catalog_url, SchemaDriftError)[0]
    assert error.differences == ("unexpected column runs.note",)
    assert error.fix_sql == ("ALTER TABLE runs DROP COLUMN note",)
    execute_sql(catalog_url, *error.fix_sql)
    _works(catalog_url)


def test_tables_of_another_revision_than_recorded_get_the_statement_recording_it(catalog_url):
    # The initial revision's tables, but alembic_version claims head (a restore of the tables
    # without their version row, say): recording the real revision makes upgrade work.
    migrate(catalog_url, INITIAL)
    execute_sql(catalog_url, f"UPDATE alembic_version SET version_num = '{HEAD}'")
    error = _refusals(catalog_url, SchemaDriftError)[0]
    assert "missing table attempts" in error.differences
    assert "unexpected column checkpoints.attempt_id" in error.differences
    assert error.matches == INITIAL
    assert error.fix_sql == (f"UPDATE alembic_version SET version_num = '{INITIAL}'",)
    assert f"then run `zephon db upgrade --catalog {catalog.mask_url(catalog_url)}`" in str(error)
    execute_sql(catalog_url, *error.fix_sql)
    assert catalog.current_revision(catalog_url) == INITIAL
    assert catalog.upgrade(catalog_url) == (INITIAL, HEAD)
    _works(catalog_url)


def test_an_older_revision_with_drift_is_refused_rather_than_sent_to_upgrade(catalog_url):
    migrate(catalog_url, INITIAL)
    _drop_column(catalog_url, "checkpoints", "bytes")
    for error in _refusals(catalog_url, SchemaDriftError):
        assert error.revision == INITIAL and error.head == HEAD
        assert error.differences == ("missing column checkpoints.bytes",)


def test_an_older_revision_whose_index_exists_already_upgrades(catalog_url):
    # An operator created the new index by hand before upgrading: no drift, upgrade works.
    migrate(catalog_url, EPOCHS)
    execute_sql(catalog_url, "CREATE INDEX ix_events_at ON events (at)")
    with pytest.raises(SchemaOutdatedError) as caught:
        Catalog(catalog_url)
    assert caught.value.known and caught.value.current == EPOCHS
    assert catalog.current_revision(catalog_url) == EPOCHS
    assert catalog.upgrade(catalog_url) == (EPOCHS, HEAD)
    _works(catalog_url)


def test_an_empty_alembic_version_beside_tables_at_head_gets_the_insert_that_records_it(
    catalog_url,
):
    Catalog(catalog_url).close()
    execute_sql(catalog_url, "DELETE FROM alembic_version")
    errors = _refusals(catalog_url, SchemaUnversionedError)
    for error in errors:
        assert error.version_table and error.matches == HEAD
        assert error.fix_sql == (f"INSERT INTO alembic_version (version_num) VALUES ('{HEAD}')",)
        assert "its alembic_version table has no row" in str(error)
        assert "zephon db upgrade" not in str(error)  # at head: nothing to upgrade after
    execute_sql(catalog_url, *errors[0].fix_sql)
    _works(catalog_url)


def test_an_empty_alembic_version_beside_older_tables_is_recorded_then_upgraded(catalog_url):
    migrate(catalog_url, EPOCHS)
    execute_sql(catalog_url, "DELETE FROM alembic_version")
    error = _refusals(catalog_url, SchemaUnversionedError)[0]
    assert error.matches == EPOCHS
    assert "then run `zephon db upgrade --catalog" in str(error)
    execute_sql(catalog_url, *error.fix_sql)
    assert catalog.upgrade(catalog_url) == (EPOCHS, HEAD)
    _works(catalog_url)


def test_tables_without_alembic_version_get_the_create_table_and_insert(catalog_url):
    migrate(catalog_url, INITIAL)
    execute_sql(catalog_url, "DROP TABLE alembic_version")
    error = _refusals(catalog_url, SchemaUnversionedError)[0]
    assert not error.version_table and error.matches == INITIAL
    assert error.fix_sql[0].startswith("CREATE TABLE alembic_version")
    execute_sql(catalog_url, *error.fix_sql)
    assert catalog.upgrade(catalog_url) == (INITIAL, HEAD)
    _works(catalog_url)


def test_unrecorded_tables_matching_no_revision_are_refused_naming_the_closest(catalog_url):
    Catalog(catalog_url).close()
    execute_sql(catalog_url, "DELETE FROM alembic_version")
    _drop_column(catalog_url, "events", "detail")
    error = _refusals(catalog_url, SchemaUnversionedError)[0]
    assert (error.matches, error.fix_sql, error.closest) == (None, (), HEAD)
    assert error.differences == ("missing column events.detail",)
    assert f"closest {HEAD}: missing column events.detail" in str(error)
    assert "restore the database from a backup" in str(error)


def test_an_empty_alembic_version_and_no_tables_is_created_by_upgrade(catalog_url):
    execute_sql(catalog_url, "CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
    assert catalog.current_revision(catalog_url) is None
    with pytest.raises(SchemaOutdatedError) as caught:
        Catalog(catalog_url)
    assert caught.value.current is None and caught.value.known
    assert catalog.upgrade(catalog_url) == (None, HEAD)
    _works(catalog_url)


def test_an_unknown_revision_is_refused_by_current_revision_too(catalog_url):
    Catalog(catalog_url).close()
    execute_sql(catalog_url, "UPDATE alembic_version SET version_num = '0123456789ab'")
    for error in _refusals(catalog_url, SchemaOutdatedError):
        assert not error.known and "newer Zephon" in str(error)


def _drop_unique_constraint_of_attempts(url: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            if engine.dialect.name == "postgresql":
                connection.execute(
                    text("ALTER TABLE attempts DROP CONSTRAINT uq_attempts_run_id_epoch")
                )
                return
            # SQLite cannot drop a constraint: rebuild the table without it. Nothing
            # references attempts, so foreign keys do not mind.
            ddl = connection.execute(
                text("SELECT sql FROM sqlite_master WHERE name = 'attempts'")
            ).scalar_one()
            without = ddl.replace(
                ", \n\tCONSTRAINT uq_attempts_run_id_epoch UNIQUE (run_id, epoch)", ""
            )
            assert without != ddl
            connection.execute(text("DROP TABLE attempts"))
            connection.execute(text(without))
    finally:
        engine.dispose()


def test_a_dropped_constraint_is_found_by_the_thorough_check_of_current_and_upgrade(catalog_url):
    # The open path compares tables, columns and indexes only (it must stay cheap); `zephon db
    # current` and `zephon db upgrade` also run Alembic's compare_metadata.
    Catalog(catalog_url).close()
    _drop_unique_constraint_of_attempts(catalog_url)
    Catalog(catalog_url).close()
    for attempt in (catalog.current_revision, catalog.upgrade):
        with pytest.raises(SchemaDriftError) as caught:
            attempt(catalog_url)
        assert caught.value.differences == (
            "missing unique constraint uq_attempts_run_id_epoch on attempts",
        )
        assert "restore the database from a backup" in str(caught.value)


def test_fingerprints_of_every_revision_are_the_same_on_both_backends(catalog_url):
    # Older revisions' fingerprints come from a scratch SQLite database; they must equal what
    # the real backend has after the same migrations.
    fingerprints = schema.revision_fingerprints()
    assert list(fingerprints)[-1] == HEAD and INITIAL in fingerprints
    assert fingerprints[HEAD] == drift.model_fingerprint()
    engine = create_engine(catalog_url)
    try:
        for revision, expected in fingerprints.items():
            migrate(catalog_url, revision)
            with engine.connect() as connection:
                live, version_table = drift.read_structure(connection)
            assert version_table and live == expected, revision
    finally:
        engine.dispose()


def test_opening_a_catalog_at_head_checks_the_schema_with_two_queries(catalog_url):
    Catalog(catalog_url).close()
    db = Database(catalog_url)
    statements: list[str] = []

    @event.listens_for(db.engine, "before_cursor_execute")
    def _count(_conn, _cursor, statement, *_args) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append(statement)

    try:
        schema.ensure_schema(db)
    finally:
        db.dispose()
    # pool_pre_ping's probe on PostgreSQL is not a SELECT through this hook
    assert len(statements) == 2, statements
    assert "alembic_version" in statements[1]
