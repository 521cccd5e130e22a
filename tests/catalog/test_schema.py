"""Schema management: created at head when empty, equal to the ORM models, stale ones refused,
upgrades through ``zephon db upgrade``'s function, concurrent first opens, and query plans."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime

import pytest
from alembic import command
from sqlalchemy import create_engine, insert, text
from sqlalchemy.exc import IntegrityError

from tests.catalog import workers
from tests.catalog.conftest import diff_against_models, execute_sql, migrate
from zephon import catalog, migrations
from zephon.catalog import (
    Catalog,
    MigrationsNotFoundError,
    SchemaOutdatedError,
    SchemaUnversionedError,
    schema,
)
from zephon.catalog.engine import Database
from zephon.catalog.models import Base, Checkpoint, CheckpointState, Run
from zephon.catalog.queries import latest_committed


def test_an_empty_database_is_created_at_head_on_first_open(catalog_url):
    with Catalog(catalog_url) as opened:
        assert opened.current_revision() == catalog.head_revision()
        assert [e.action for e in opened.events()] == ["schema_created"]
    assert catalog.current_revision(catalog_url) == catalog.head_revision()


def test_upgrade_from_empty_equals_the_orm_models(catalog_url):
    assert catalog.upgrade(catalog_url) == (None, catalog.head_revision())
    assert diff_against_models(catalog_url) == []


def test_reopening_a_catalog_at_head_changes_nothing(catalog_url):
    Catalog(catalog_url).close()
    with Catalog(catalog_url) as opened:
        assert len(opened.events()) == 1
        assert catalog.upgrade(catalog_url) == (catalog.head_revision(),) * 2


def test_an_alembic_version_table_without_a_row_is_behind_and_upgrade_fixes_it(catalog_url):
    execute_sql(catalog_url, "CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
    with pytest.raises(SchemaOutdatedError) as caught:
        Catalog(catalog_url)
    error = caught.value
    assert error.current is None and error.known and error.head == catalog.head_revision()
    assert f"zephon db upgrade --catalog {catalog.mask_url(catalog_url)}" in str(error)

    assert catalog.upgrade(catalog_url) == (None, catalog.head_revision())
    with Catalog(catalog_url) as opened:
        assert opened.list_runs() == []
    assert diff_against_models(catalog_url) == []


def test_an_unknown_revision_is_refused_by_open_and_by_upgrade(catalog_url):
    Catalog(catalog_url).close()
    execute_sql(catalog_url, "UPDATE alembic_version SET version_num = '0123456789ab'")
    for attempt in (lambda: Catalog(catalog_url), lambda: catalog.upgrade(catalog_url)):
        with pytest.raises(SchemaOutdatedError) as caught:
            attempt()
        assert caught.value.current == "0123456789ab" and not caught.value.known
        assert "zephon db upgrade" in str(caught.value)
        assert "newer Zephon" in str(caught.value)


def _migrations_with_one_more_revision(tmp_path) -> str:
    copy = tmp_path / "migrations_next"
    shutil.copytree(migrations.LOCATION, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "versions" / "feedc0ffee01_events_action_index.py").write_text(
        "from alembic import op\n"
        "revision = 'feedc0ffee01'\n"
        f"down_revision = {catalog.head_revision()!r}\n"
        "branch_labels = None\n"
        "depends_on = None\n"
        "def upgrade():\n"
        "    op.create_index('ix_events_action', 'events', ['action'])\n"
        "def downgrade():\n"
        "    op.drop_index('ix_events_action', table_name='events')\n"
    )
    return str(copy)


def test_migrations_without_a_revision_are_a_catalog_error_naming_the_fix(tmp_path):
    copy = tmp_path / "migrations_empty"
    shutil.copytree(migrations.LOCATION, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for revision in (copy / "versions").glob("*.py"):
        revision.unlink()
    with pytest.raises(MigrationsNotFoundError) as caught:
        schema.head_revision(str(copy))
    assert isinstance(caught.value, catalog.CatalogError)
    assert caught.value.location == str(copy)
    assert "\n" not in str(caught.value) and "reinstall the zephon package" in str(caught.value)


def test_a_database_behind_the_code_is_refused_until_upgraded(catalog_url, tmp_path):
    # The installed head plays "the old release"; a copy of the migrations with one more
    # revision plays "the new release" that finds the database behind it.
    Catalog(catalog_url).close()
    newer = _migrations_with_one_more_revision(tmp_path)
    db = Database(catalog_url)
    try:
        with pytest.raises(SchemaOutdatedError) as caught:
            schema.ensure_schema(db, script_location=newer)
        assert caught.value.known and caught.value.current == catalog.head_revision()
        assert caught.value.head == "feedc0ffee01"
        assert "zephon db upgrade --catalog" in str(caught.value)

        assert schema.upgrade_schema(db, newer) == (catalog.head_revision(), "feedc0ffee01")
        schema.ensure_schema(db, script_location=newer)
        assert schema.current_revision(db, newer) == "feedc0ffee01"
    finally:
        db.dispose()
    # ...and the old release now meets a revision it has never heard of.
    with pytest.raises(SchemaOutdatedError) as caught:
        Catalog(catalog_url)
    assert not caught.value.known


def test_catalog_tables_without_alembic_version_are_refused(catalog_url):
    engine = create_engine(catalog_url)
    Base.metadata.create_all(engine)
    engine.dispose()
    for attempt in (lambda: Catalog(catalog_url), lambda: catalog.upgrade(catalog_url)):
        with pytest.raises(SchemaUnversionedError) as caught:
            attempt()
        assert set(caught.value.tables) == {
            "runs",
            "attempts",
            "checkpoints",
            "checkpoint_replicas",
            "events",
        }
        assert "alembic_version" in str(caught.value)


INITIAL = "a1bd075f368c"


_OLD_ROWS = (
    "INSERT INTO runs (id, name, storage_url, kind, status, num_to_keep, created_at, "
    "updated_at) VALUES (1, 'old', '/c/old', 'train', 'active', 2, :at, :at)",
    "INSERT INTO checkpoints (run_id, step, state, path, attempt_id, bytes, pinned, created_at, "
    "committed_at, updated_at) VALUES (1, 10, 'committed', '/c/old/save-10', 'aaaa', 5, "
    ":no, :at, :at, :at)",
    "INSERT INTO checkpoints (run_id, step, state, path, attempt_id, pinned, created_at, "
    "updated_at) VALUES (1, 20, 'pending', '/c/old/save-20', 'bbbb', :no, :at, :at)",
    "INSERT INTO checkpoints (run_id, step, state, path, attempt_id, pinned, failure_reason, "
    "created_at, updated_at) VALUES (1, 15, 'failed', '/c/old/save-15', 'cccc', :no, 'x', "
    ":at, :at)",
)


def _insert_old_rows(url: str) -> None:
    engine = create_engine(url)
    # SQLite stores UtcDateTime as fixed-width naive UTC text; PostgreSQL takes the value.
    at = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    at_value = "2026-11-30 12:00:00.000000" if engine.dialect.name == "sqlite" else at
    try:
        with engine.begin() as connection:
            for statement in _OLD_ROWS:
                connection.execute(text(statement), {"at": at_value, "no": False})
    finally:
        engine.dispose()


def test_a_catalog_at_the_initial_revision_upgrades_keeping_its_rows(catalog_url):
    migrate(catalog_url, INITIAL)
    _insert_old_rows(catalog_url)
    with pytest.raises(SchemaOutdatedError) as caught:
        Catalog(catalog_url)
    assert caught.value.current == INITIAL and caught.value.known

    assert catalog.upgrade(catalog_url) == (INITIAL, catalog.head_revision())
    assert diff_against_models(catalog_url) == []
    with Catalog(catalog_url) as opened:
        run = opened.get_run("old")
        assert (run.epoch, run.num_to_keep) == (0, 2)
        rows = {c.step: c for c in opened.list_checkpoints("old")}
        assert {s: (c.state, c.save_id, c.epoch) for s, c in rows.items()} == {
            10: ("committed", "aaaa", 0),
            15: ("failed", "cccc", 0),
            20: ("pending", "bbbb", 0),
        }
        assert rows[10].committed_at == datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
        assert opened.latest_committed("old").step == 10
        assert opened.list_attempts("old") == []
        # The old rows take part in fencing as epoch 0: the first attempt abandons above 10.
        registration = opened.register_attempt(
            "old",
            epoch=1,
            attempt_id="f" * 32,
            host="h",
            pid=1,
            started_at=datetime.now(UTC),
            resumed_from=10,
        )
        assert registration.abandoned == (15, 20)
        # The old save of step 20 can no longer be committed.
        with pytest.raises(catalog.FencedOutError):
            opened.mark_committed("old", 20, "bbbb", bytes=1, file_count=1, manifest_checksum=None)
        assert [e.action for e in opened.events()][-1] == "schema_upgraded"


def test_a_downgrade_to_the_initial_revision_keeps_the_rows_under_their_old_names(catalog_url):
    with Catalog(catalog_url) as opened:
        opened.ensure_run("r", "/c")
        opened.begin_checkpoint("r", 1, "/c/1", save_id="s-1")
        opened.register_attempt(
            "r",
            epoch=1,
            attempt_id="a" * 32,
            host="h",
            pid=1,
            started_at=datetime.now(UTC),
            resumed_from=None,
        )
    migrate(catalog_url, INITIAL, how=command.downgrade)
    engine = create_engine(catalog_url)
    try:
        with engine.connect() as connection:
            row = connection.execute(text("SELECT state, attempt_id FROM checkpoints")).one()
            assert tuple(row) == ("failed", "s-1")  # stale has no place in the old schema
    finally:
        engine.dispose()
    assert catalog.upgrade(catalog_url) == (INITIAL, catalog.head_revision())
    assert diff_against_models(catalog_url) == []


@pytest.mark.parametrize("upgraded", [False, True], ids=["created-at-head", "upgraded"])
def test_the_state_constraint_allows_every_state_and_nothing_else(catalog_url, upgraded):
    if upgraded:
        migrate(catalog_url, INITIAL)
    catalog.upgrade(catalog_url)
    with Catalog(catalog_url) as opened:
        opened.ensure_run("r", "/c")
        opened.begin_checkpoint("r", 1, "/c/1")
    engine = create_engine(catalog_url)
    try:
        for state in CheckpointState:
            with engine.begin() as connection:
                connection.execute(text("UPDATE checkpoints SET state = :s"), {"s": state.value})
        with pytest.raises(IntegrityError), engine.begin() as connection:
            connection.execute(text("UPDATE checkpoints SET state = 'bogus'"))
    finally:
        engine.dispose()


def test_unrelated_tables_do_not_stop_creation(catalog_url):
    execute_sql(catalog_url, "CREATE TABLE someone_elses (id INTEGER PRIMARY KEY)")
    with Catalog(catalog_url) as opened:
        assert opened.current_revision() == catalog.head_revision()


@pytest.mark.slow
def test_processes_opening_an_empty_database_at_once_all_succeed(catalog_url):
    results = workers.run_in_processes([(workers.open_catalog, (catalog_url,))] * 4)
    assert results == [catalog.head_revision()] * 4
    with Catalog(catalog_url) as opened:
        assert [e.action for e in opened.events()] == ["schema_created"]


def _populate(url: str, runs: int, per_run: int) -> None:
    now = datetime.now(UTC)
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(
                insert(Run),
                [
                    dict(
                        name=f"run-{r}",
                        storage_url=f"/c/run-{r}",
                        kind="train",
                        status="active",
                        created_at=now,
                        updated_at=now,
                    )
                    for r in range(runs)
                ],
            )
            ids = dict(connection.execute(text("SELECT name, id FROM runs")).all())
            states = ["committed", "committed", "deleted", "pending"]
            connection.execute(
                insert(Checkpoint),
                [
                    dict(
                        run_id=ids[f"run-{r}"],
                        step=s,
                        state=states[s % 4],
                        path=f"/c/{s}",
                        save_id="a",
                        pinned=False,
                        created_at=now,
                        updated_at=now,
                    )
                    for r in range(runs)
                    for s in range(per_run)
                ],
            )
    finally:
        engine.dispose()


def test_latest_committed_is_one_backward_index_scan(catalog_url):
    Catalog(catalog_url).close()
    _populate(catalog_url, runs=20, per_run=500)
    statement = latest_committed("run-7")
    engine = create_engine(catalog_url)
    try:
        with engine.connect() as connection:
            sql = str(statement.compile(engine, compile_kwargs={"literal_binds": True}))
            if engine.dialect.name == "postgresql":
                connection.execute(text("ANALYZE"))
                plan = "\n".join(connection.execute(text(f"EXPLAIN {sql}")).scalars())
                assert "Index Scan Backward using ix_checkpoints_run_id_state_step" in plan, plan
                assert "Sort" not in plan and "Seq Scan on checkpoints" not in plan, plan
            else:
                rows = connection.execute(text(f"EXPLAIN QUERY PLAN {sql}")).all()
                plan = "\n".join(row[-1] for row in rows)
                assert "USING INDEX ix_checkpoints_run_id_state_step" in plan, plan
                assert "TEMP B-TREE" not in plan, plan
            assert connection.execute(statement).one().step == 497
    finally:
        engine.dispose()


EVENTS_AT = "3a0e83d9015e"


def test_the_timings_and_replicas_revision_upgrades_keeping_every_row(catalog_url):
    migrate(catalog_url, INITIAL)
    _insert_old_rows(catalog_url)
    migrate(catalog_url, EVENTS_AT)
    with pytest.raises(SchemaOutdatedError) as caught:
        Catalog(catalog_url)
    assert caught.value.current == EVENTS_AT

    assert catalog.upgrade(catalog_url) == (EVENTS_AT, catalog.head_revision())
    assert diff_against_models(catalog_url) == []
    with Catalog(catalog_url) as opened:
        rows = {c.step: c for c in opened.list_checkpoints("old")}
        assert {s: (c.state, c.save_id, c.bytes, c.timings) for s, c in rows.items()} == {
            10: ("committed", "aaaa", 5, None),
            15: ("failed", "cccc", None, None),
            20: ("pending", "bbbb", None, None),
        }
        assert rows[15].failure_reason == "x"
        assert opened.latest_committed("old").step == 10
        assert opened.replicas("old") == []
        # The old rows take timings and replicas like new ones.
        opened.add_timings("old", 10, "aaaa", {"total_s": 1.5})
        opened.replica_started(
            "old", 10, tier="save_dir", host="", location="/c/old/save-10", save_id="aaaa"
        )
        assert opened.get_checkpoint("old", 10).timings == {"total_s": 1.5}


def test_a_downgrade_below_timings_and_replicas_drops_only_them(catalog_url):
    with Catalog(catalog_url) as opened:
        opened.ensure_run("r", "/c")
        row = opened.begin_checkpoint("r", 1, "/c/r/save-1", save_id="s-1")
        opened.mark_committed(
            "r", 1, "s-1", bytes=7, file_count=1, manifest_checksum="m", timings={"total_s": 2}
        )
        opened.replica_started(
            "r", 1, tier="local", host="n1", location="/l/r/save-1", save_id=row.save_id
        )
    migrate(catalog_url, EVENTS_AT, how=command.downgrade)
    engine = create_engine(catalog_url)
    try:
        with engine.connect() as connection:
            row = connection.execute(text("SELECT state, save_id, bytes FROM checkpoints")).one()
            assert tuple(row) == ("committed", "s-1", 7)
            tables = {
                name
                for (name,) in connection.execute(
                    text(
                        "SELECT name FROM sqlite_master WHERE type = 'table'"
                        if engine.dialect.name == "sqlite"
                        else "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                    )
                )
            }
            assert "checkpoint_replicas" not in tables and "checkpoints" in tables
    finally:
        engine.dispose()
    with pytest.raises(SchemaOutdatedError):
        Catalog(catalog_url)
    assert catalog.upgrade(catalog_url) == (EVENTS_AT, catalog.head_revision())
    assert diff_against_models(catalog_url) == []
    with Catalog(catalog_url) as opened:
        again = opened.get_checkpoint("r", 1)
        assert (again.state, again.bytes, again.timings) == ("committed", 7, None)
        assert opened.replicas("r") == []
