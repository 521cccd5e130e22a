"""``checkpoints.stall_s``, the stall of ``timings`` as a column, on SQLite and PostgreSQL: its
revision fills it from existing rows' timings, every write of timings keeps the two equal,
and the dashboard's goodput reads use ``ix_checkpoints_attempt_saves`` alone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import command

from tests.catalog.conftest import commit_step, diff_against_models, migrate, register
from zephon import catalog
from zephon.catalog import Catalog
from zephon.catalog.models import Checkpoint, Run, UtcDateTime
from zephon.catalog.roles.overview import _attempt_saves
from zephon.migrations.columns import JSON_DOCUMENT

BEFORE = "5d41c0a7e9b2"  # the revision before the column
INDEX = "ix_checkpoints_attempt_saves"
AT = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)

# step -> timings of a row written before the column existed, and the stall it must get
OLD_TIMINGS: dict[int, tuple[dict | None, float | None]] = {
    1: ({"stall_s": 0.25, "write_s": 1.5}, 0.25),
    2: ({"write_s": 2.0}, None),
    3: (None, None),
    4: ({"stall_s": 3, "total_s": 4.0}, 3.0),
    5: ({"stall_s": 0.0}, 0.0),
}


def _stalls(url: str) -> dict[int, float | None]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT step, stall_s FROM checkpoints"))
            return {step: stall for step, stall in rows}
    finally:
        engine.dispose()


def _insert_rows_before_the_column(url: str) -> None:
    # the tables of revision BEFORE, spelled out: the models have the column already
    runs = sa.table(
        "runs",
        *(sa.column(c) for c in ("id", "name", "storage_url", "kind", "status")),
        sa.column("created_at", UtcDateTime()),
        sa.column("updated_at", UtcDateTime()),
    )
    checkpoints = sa.table(
        "checkpoints",
        *(sa.column(c) for c in ("run_id", "step", "state", "path", "save_id", "pinned")),
        sa.column("timings", JSON_DOCUMENT),
        sa.column("created_at", UtcDateTime()),
        sa.column("committed_at", UtcDateTime()),
        sa.column("updated_at", UtcDateTime()),
    )
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(
                sa.insert(runs).values(
                    id=1,
                    name="old",
                    storage_url="/c/old",
                    kind="train",
                    status="active",
                    created_at=AT,
                    updated_at=AT,
                )
            )
            for step, (timings, _) in OLD_TIMINGS.items():
                at = AT + timedelta(minutes=step)
                connection.execute(
                    sa.insert(checkpoints).values(
                        run_id=1,
                        step=step,
                        state="committed",
                        path=f"/c/old/save-{step}",
                        save_id=f"s{step}",
                        pinned=False,
                        timings=timings,
                        created_at=at,
                        committed_at=at,
                        updated_at=at,
                    )
                )
    finally:
        engine.dispose()


def test_the_upgrade_fills_the_stall_of_existing_rows_from_their_timings(catalog_url):
    migrate(catalog_url, BEFORE)
    _insert_rows_before_the_column(catalog_url)

    assert catalog.upgrade(catalog_url) == (BEFORE, catalog.head_revision())
    assert diff_against_models(catalog_url) == []
    assert _stalls(catalog_url) == {step: stall for step, (_, stall) in OLD_TIMINGS.items()}
    with Catalog(catalog_url, read_only=True) as viewer:
        assert [row.stall_s for row in viewer.save_rows(["old"])["old"]] == [
            0.25,
            0.0,
            0.0,
            3.0,
            0.0,
        ]
        (summary,) = viewer.save_summaries(["old"])["old"]
        assert (summary.saves, summary.stall_s) == (5, 3.25)
        # the timings themselves are untouched
        assert [c.timings for c in viewer.list_checkpoints("old")] == [
            timings for timings, _ in OLD_TIMINGS.values()
        ]


def test_a_downgrade_drops_the_column_and_its_index_and_an_upgrade_fills_it_again(catalog_url):
    with Catalog(catalog_url) as opened:
        opened.ensure_run("r", "/c/r")
        row = opened.begin_checkpoint("r", 1, "/c/r/save-1")
        opened.mark_committed(
            "r",
            1,
            row.save_id,
            bytes=1,
            file_count=1,
            manifest_checksum=None,
            timings={"stall_s": 0.5, "total_s": 2.0},
        )
    migrate(catalog_url, BEFORE, how=command.downgrade)
    engine = sa.create_engine(catalog_url)
    try:
        inspector = sa.inspect(engine)
        assert "stall_s" not in {c["name"] for c in inspector.get_columns("checkpoints")}
        assert INDEX not in {i["name"] for i in inspector.get_indexes("checkpoints")}
    finally:
        engine.dispose()

    assert catalog.upgrade(catalog_url) == (BEFORE, catalog.head_revision())
    assert _stalls(catalog_url) == {1: 0.5}
    with Catalog(catalog_url) as opened:
        assert opened.get_checkpoint("r", 1).timings == {"stall_s": 0.5, "total_s": 2.0}


def test_every_write_of_timings_keeps_the_stall_column_equal_to_timings_stall(catalog_url):
    with Catalog(catalog_url) as opened:
        opened.ensure_run("r", "/c/r")

        def begin(step: int) -> str:
            return opened.begin_checkpoint("r", step, f"/c/r/save-{step}").save_id

        def commit(step: int, save_id: str, **timings: float) -> None:
            opened.mark_committed(
                "r",
                step,
                save_id,
                bytes=1,
                file_count=1,
                manifest_checksum=None,
                timings=timings or None,
            )

        saves = {}
        for step in range(1, 8):
            saves[step] = begin(step)
        commit(1, saves[1], stall_s=0.5, write_s=1.0)  # timed at the commit
        commit(2, saves[2])  # never timed
        commit(3, saves[3], write_s=1.0)
        opened.add_timings("r", 3, saves[3], {"stall_s": 0.25})  # an async save's stall, later
        commit(4, saves[4], stall_s=0.5)
        opened.add_timings("r", 4, saves[4], {"upload_s": 3.0})  # another phase: stall kept
        opened.add_timings("r", 4, saves[4], {"stall_s": 0.75})  # overwritten
        commit(5, saves[5], write_s=1.0)
        commit(5, saves[5], stall_s=0.125)  # a retried commit merges into the committed row
        opened.add_timings("r", 6, saves[6], {"stall_s": 1.0})  # still pending
        opened.mark_failed("r", 6, saves[6], "crashed")
        begin(6)  # re-armed: the failed save's timings are gone
        commit(7, saves[7], stall_s=2.0)
        # storage holds another save's marker at step 7: its row takes that save, not its timings
        opened.upsert_committed(
            "r",
            7,
            "/c/r/save-7",
            save_id="other",
            epoch=0,
            bytes=1,
            file_count=1,
            manifest_checksum=None,
        )
        expected = {1: 0.5, 2: None, 3: 0.25, 4: 0.75, 5: 0.125, 6: None, 7: None}
        timings = {c.step: c.timings for c in opened.list_checkpoints("r")}
    stalls = _stalls(catalog_url)
    assert stalls == expected
    assert stalls == {step: (t or {}).get("stall_s") for step, t in timings.items()}


def _fill(url: str, runs: int, per_run: int) -> None:
    Catalog(url).close()
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(
                sa.insert(Run),
                [
                    dict(
                        name=f"run-{r}",
                        storage_url=f"/c/run-{r}",
                        kind="train",
                        status="active",
                        created_at=AT,
                        updated_at=AT,
                    )
                    for r in range(runs)
                ],
            )
            ids = dict(connection.execute(sa.text("SELECT name, id FROM runs")).all())
            connection.execute(
                sa.insert(Checkpoint),
                [
                    dict(
                        run_id=ids[f"run-{r}"],
                        step=s,
                        state="committed",
                        path=f"/c/{s}",
                        save_id="a",
                        epoch=1 + 2 * s // per_run,
                        pinned=False,
                        timings={"stall_s": 0.5},
                        stall_s=0.5,
                        created_at=AT + timedelta(minutes=s),
                        committed_at=AT,
                        updated_at=AT,
                    )
                    for r in range(runs)
                    for s in range(per_run)
                ],
            )
    finally:
        engine.dispose()


def test_the_goodput_aggregate_reads_only_its_index(catalog_url):
    _fill(catalog_url, runs=100, per_run=200)
    with Catalog(catalog_url) as opened:
        register(opened, "run-7", 1)
        register(opened, "run-7", 2, resumed_from=50)
        commit_step(opened, "run-7", 500, epoch=2)
    engine = sa.create_engine(catalog_url)
    try:
        with engine.connect() as connection:
            ids = list(
                connection.execute(
                    sa.text("SELECT id FROM runs WHERE name IN ('run-7', 'run-8', 'run-9')")
                ).scalars()
            )
            statement = _attempt_saves(ids, engine.dialect.name)
            sql = str(statement.compile(engine, compile_kwargs={"literal_binds": True}))
            if engine.dialect.name == "postgresql":
                connection.execute(sa.text("ANALYZE"))
                plan = "\n".join(connection.execute(sa.text(f"EXPLAIN {sql}")).scalars())
                assert f"Index Only Scan using {INDEX} on checkpoints" in plan, plan
                assert "Seq Scan on checkpoints" not in plan, plan
            else:
                rows = connection.execute(sa.text(f"EXPLAIN QUERY PLAN {sql}")).all()
                plan = "\n".join(row[-1] for row in rows)
                searches = [line for line in plan.splitlines() if "checkpoints" in line]
                assert searches and all(f"COVERING INDEX {INDEX}" in s for s in searches), plan
            assert len(connection.execute(statement).all()) == 3 * 2  # two attempts each
    finally:
        engine.dispose()
