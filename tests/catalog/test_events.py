"""Events retention: ``prune_events`` deletes what is older than the cut-off, in bounded
batches of their own transactions, leaves the rest, records one ``events_pruned`` event, and
finds its batches through ``ix_events_at``. On SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import create_engine, event, insert, text

from zephon.catalog import Catalog
from zephon.catalog.audit import delete_batch
from zephon.catalog.models import Event

# The real clock: schema_created and run events are written with it.
NOW = datetime.now(UTC)


def _plant(catalog: Catalog, ages_in_days: list[float]) -> None:
    """Events ``age`` days before NOW, written straight into the table."""
    engine = create_engine(catalog_url_of(catalog))
    try:
        with engine.begin() as connection:
            connection.execute(
                insert(Event),
                [
                    dict(
                        at=NOW - timedelta(days=age),
                        actor="t@h:1",
                        action="planted",
                        run_name="r",
                        step=i,
                        detail={"age": age},
                    )
                    for i, age in enumerate(ages_in_days)
                ],
            )
    finally:
        engine.dispose()


def catalog_url_of(catalog: Catalog) -> str:
    return catalog._db.engine.url.render_as_string(hide_password=False)


def _planted_ages(catalog: Catalog) -> list[float]:
    return sorted(e.detail["age"] for e in catalog.events(limit=10_000) if e.action == "planted")


def test_prune_events_deletes_only_what_is_older_than_the_cutoff(catalog):
    _plant(catalog, [400, 100, 31, 29, 1, 0])
    deleted = catalog.prune_events(older_than=timedelta(days=30), now=NOW)
    assert deleted == 3
    assert _planted_ages(catalog) == [0, 1, 29]
    pruned = catalog.events(limit=1)[0]
    assert pruned.action == "events_pruned"
    assert pruned.detail == {
        "before": (NOW - timedelta(days=30)).isoformat(),
        "deleted": 3,
        "batches": 1,
    }
    # schema_created is newer than NOW - 30 days (it happened today), so it stays.
    assert "schema_created" in [e.action for e in catalog.events()]


def test_an_event_exactly_at_the_cutoff_is_kept(catalog):
    _plant(catalog, [30, 30.0001])
    assert catalog.prune_events(older_than=timedelta(days=30), now=NOW) == 1
    assert _planted_ages(catalog) == [30]


def test_prune_events_works_in_batches_each_its_own_transaction(catalog):
    _plant(catalog, [50 + i for i in range(10)] + [1])
    deletes: list[str] = []
    commits: list[int] = []

    @event.listens_for(catalog._db.engine, "before_cursor_execute")
    def _statements(_conn, _cursor, statement, *_args) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            deletes.append(statement)

    @event.listens_for(catalog._db.engine, "commit")
    def _commits(_conn) -> None:
        commits.append(len(deletes))

    assert catalog.prune_events(older_than=timedelta(days=7), now=NOW, batch_size=3) == 10
    assert len(deletes) == 4  # 3 + 3 + 3 + 1
    assert commits == [1, 2, 3, 4]  # one transaction per batch
    assert _planted_ages(catalog) == [1]
    pruned = catalog.events(limit=1)[0]
    assert (pruned.detail["deleted"], pruned.detail["batches"]) == (10, 4)
    assert [e.action for e in catalog.events()].count("events_pruned") == 1


def test_nothing_to_prune_still_records_that_pruning_ran(catalog):
    assert catalog.prune_events(older_than=timedelta(days=30)) == 0
    pruned = catalog.events(limit=1)[0]
    assert pruned.action == "events_pruned" and pruned.detail["deleted"] == 0


def test_pruning_everything_keeps_only_its_own_event(catalog, run):
    catalog.begin_checkpoint(run, 1, "/c/r/save-1")
    later = datetime.now(UTC) + timedelta(seconds=1)
    assert catalog.prune_events(older_than=timedelta(0), now=later) == 3
    assert [e.action for e in catalog.events()] == ["events_pruned"]
    # the run and its checkpoint are untouched: events are a log, not state
    assert catalog.get_checkpoint(run, 1).state == "pending"


def test_a_prune_batch_is_a_range_scan_of_ix_events_at(catalog):
    _plant(catalog, [float(i) for i in range(2000)])
    engine = create_engine(catalog_url_of(catalog))
    sqlite = engine.dialect.name == "sqlite"
    try:
        with engine.connect() as connection:
            if not sqlite:
                connection.exec_driver_sql("ANALYZE events")

            # The batch statement as the catalog sends it, explained instead of executed.
            @event.listens_for(connection, "before_cursor_execute", retval=True)
            def _explain(_conn, _cursor, statement, parameters, _context, _many):
                return ("EXPLAIN QUERY PLAN " if sqlite else "EXPLAIN ") + statement, parameters

            statement = delete_batch(NOW - timedelta(days=1000), 100, engine.dialect.name)
            rows = connection.execute(statement)
            plan = "\n".join(str(row[-1]) for row in rows)
        assert "ix_events_at" in plan, plan
        if sqlite:
            assert "SEARCH events USING COVERING INDEX ix_events_at (at<?)" in plan, plan
            assert "SEARCH events USING INTEGER PRIMARY KEY (rowid=?)" in plan, plan
        else:
            assert "Index Scan using ix_events_at on events" in plan, plan
            assert "Index Scan using pk_events on events" in plan, plan
            assert "Seq Scan" not in plan, plan
    finally:
        engine.dispose()


def test_prune_events_and_its_event_survive_a_reopen(catalog_url):
    with Catalog(catalog_url) as opened:
        _plant(opened, [90, 10])
        assert opened.prune_events(older_than=timedelta(days=30), now=NOW) == 1
    with Catalog(catalog_url) as reopened:
        assert _planted_ages(reopened) == [10]
        with reopened._db.read("count") as session:
            assert session.execute(text("SELECT count(*) FROM events")).scalar_one() == 3
