"""``latest_alone`` (one statement, no ORM: stdlib ``sqlite3`` or SQLAlchemy Core) gives the
ORM's answer: on the same catalogs, SQLite and PostgreSQL, across row states and attempts, it
answers exactly when the ORM reads the full lookup takes from the catalog alone say the
catalog can answer (a decided current attempt, no row in ``PROBED_STATES`` above the newest
committed one), with the same row, and leaves every other case to the full lookup (None).
tests/zephon/test_cli_latest.py checks the same against ``zephon.latest.find_latest`` with
storage behind it."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator

import pytest

from tests.catalog.conftest import STARTED, commit_step, execute_sql, register
from tests.conftest import database_url
from zephon.catalog import (
    PROBED_STATES,
    Catalog,
    CatalogLatest,
    RunNotFoundError,
    SchemaOutdatedError,
    latest_alone,
)
from zephon.catalog.revision import HEAD_REVISION


def orm_answer(catalog: Catalog, run: str) -> CatalogLatest | None:
    """What the full lookup reads through the ORM before it decides to ask storage
    (``zephon.latest._Rule`` with ``confirm=False``), as ``latest_alone`` reports it."""
    try:
        attempt = catalog.current_attempt(run)
    except RunNotFoundError:
        return None
    if attempt is None or not attempt.decided:
        return None  # the lineage is read from storage
    newest = catalog.latest_committed(run)
    if catalog.rows_after(run, newest.step if newest else None, states=PROBED_STATES):
        return None  # their markers are probed
    if newest is None:
        return CatalogLatest(None)
    return CatalogLatest(newest.step, newest.path, newest.save_id)


def set_state(catalog: Catalog, run: str, step: int, state: str) -> None:
    """A hand edit of one row's state (a state the API reaches only through storage)."""
    execute_sql(
        _url(catalog),
        f"UPDATE checkpoints SET state = '{state}' WHERE step = {step} "
        f"AND run_id = (SELECT id FROM runs WHERE name = '{run}')",
    )


def _url(catalog: Catalog) -> str:
    return catalog.url  # masked, which changes nothing here: the test databases have no password


def begin(catalog: Catalog, run: str, step: int, epoch: int) -> str:
    return catalog.begin_checkpoint(
        run, step, f"memory://ckpt/{run}/save-{step}", epoch=epoch
    ).save_id


def fresh(catalog: Catalog, run: str) -> None:
    """Run ``run``: attempt 1 decided (a fresh start), committed steps 10 and 20."""
    catalog.ensure_run(run, "memory://ckpt")
    register(catalog, run, 1)
    commit_step(catalog, run, 10, epoch=1)
    commit_step(catalog, run, 20, epoch=1)


def _unfenced(catalog, run):
    catalog.ensure_run(run, "memory://ckpt")
    commit_step(catalog, run, 10)  # epoch 0: no attempt ever registered


def _undecided(catalog, run):
    fresh(catalog, run)
    catalog.register_attempt(
        run, epoch=2, attempt_id="2" * 32, host="h2", pid=2, started_at=STARTED
    )  # fenced, resume point not chosen yet


def _decided_later(catalog, run):
    _undecided(catalog, run)
    catalog.decide_resume(run, epoch=2, resumed_from=20)


def _no_checkpoint(catalog, run):
    catalog.ensure_run(run, "memory://ckpt")
    register(catalog, run, 1)


def _pending_above(catalog, run):
    fresh(catalog, run)
    begin(catalog, run, 30, 1)


def _pending_at_step_0(catalog, run):
    _no_checkpoint(catalog, run)
    begin(catalog, run, 0, 1)


def _out_of_step_order(catalog, run):
    _no_checkpoint(catalog, run)
    for step in (30, 10, 20):  # the newest row is not the last one inserted
        commit_step(catalog, run, step, epoch=1)


def _pending_below(catalog, run):
    fresh(catalog, run)
    begin(catalog, run, 15, 1)


def _only_pending(catalog, run):
    _no_checkpoint(catalog, run)
    begin(catalog, run, 10, 1)


def _failed_above(catalog, run):
    fresh(catalog, run)
    catalog.mark_failed(run, 30, begin(catalog, run, 30, 1), "disk full")


def _deleted_above(catalog, run):
    fresh(catalog, run)
    commit_step(catalog, run, 30, epoch=1)
    catalog.mark_missing(run, 30)  # committed -> deleted: its marker went missing


def _deleted_below(catalog, run):
    fresh(catalog, run)
    catalog.mark_missing(run, 10)


def _newest_deleted_to_nothing(catalog, run):
    _no_checkpoint(catalog, run)
    commit_step(catalog, run, 10, epoch=1)
    catalog.mark_missing(run, 10)


def _corrupt_above(catalog, run):
    fresh(catalog, run)
    commit_step(catalog, run, 30, epoch=1)
    catalog.mark_corrupt(run, 30, catalog.get_checkpoint(run, 30).save_id, "crc mismatch")


def _stale_above(catalog, run):
    fresh(catalog, run)
    commit_step(catalog, run, 30, epoch=1)
    catalog.mark_stale(run, 30, catalog.get_checkpoint(run, 30).save_id, "abandoned")


def _deleting_above(catalog, run):
    fresh(catalog, run)
    commit_step(catalog, run, 30, epoch=1)
    set_state(catalog, run, 30, "deleting")


def _resumed_earlier(catalog, run):
    fresh(catalog, run)
    commit_step(catalog, run, 30, epoch=1)
    register(catalog, run, 2, resumed_from=10)  # 20 and 30 are abandoned (stale)


def _resumed_then_saved(catalog, run):
    _resumed_earlier(catalog, run)
    commit_step(catalog, run, 40, epoch=2)


def _third_attempt_fresh(catalog, run):
    _resumed_then_saved(catalog, run)
    register(catalog, run, 3)  # a fresh start abandons every older row


def _other_runs(catalog, run):
    fresh(catalog, run)
    catalog.ensure_run(run + "2", "memory://ckpt")
    register(catalog, run + "2", 1)
    commit_step(catalog, run + "2", 99, epoch=1)
    begin(catalog, run + "2", 100, 1)
    catalog.ensure_run(run + "-", "memory://ckpt")  # a name that shares a prefix


def _epoch_without_its_attempt(catalog, run):
    fresh(catalog, run)
    execute_sql(_url(catalog), f"UPDATE runs SET epoch = 7 WHERE name = '{run}'")


SCENARIOS = {
    "no run": lambda catalog, run: None,
    "never fenced": _unfenced,
    "attempt undecided": _undecided,
    "attempt decided after registering": _decided_later,
    "no checkpoint": _no_checkpoint,
    "committed": fresh,
    "pending above": _pending_above,
    "pending below": _pending_below,
    "only pending": _only_pending,
    "pending at step 0": _pending_at_step_0,
    "committed out of step order": _out_of_step_order,
    "failed above": _failed_above,
    "deleted above": _deleted_above,
    "deleted below": _deleted_below,
    "deleted, nothing committed": _newest_deleted_to_nothing,
    "corrupt above": _corrupt_above,
    "stale above": _stale_above,
    "deleting above": _deleting_above,
    "resumed from an earlier step": _resumed_earlier,
    "resumed, then saved": _resumed_then_saved,
    "third attempt started fresh": _third_attempt_fresh,
    "other runs beside it": _other_runs,
    "epoch without its attempt row": _epoch_without_its_attempt,
}
#: scenarios in which the catalog can answer alone (the others must be left to the full lookup)
ANSWERED = {
    "attempt decided after registering": CatalogLatest(20),
    "no checkpoint": CatalogLatest(None),
    "committed": CatalogLatest(20),
    "pending below": CatalogLatest(20),
    "committed out of step order": CatalogLatest(30),
    "deleted below": CatalogLatest(20),
    "deleted, nothing committed": CatalogLatest(None),
    "corrupt above": CatalogLatest(20),
    "stale above": CatalogLatest(20),
    "deleting above": CatalogLatest(20),
    "resumed from an earlier step": CatalogLatest(10),
    "resumed, then saved": CatalogLatest(40),
    "third attempt started fresh": CatalogLatest(None),
    "other runs beside it": CatalogLatest(20),
}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def shared(request, tmp_path_factory) -> Iterator[tuple[str, Catalog]]:
    """One catalog per backend for the scenarios, each on a run of its own (a database per
    scenario would cost more than the lookups)."""
    directory = tmp_path_factory.mktemp("lookup")
    with database_url(request.param, request, directory) as url, Catalog(url) as catalog:
        yield url, catalog


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_lookup_without_the_orm_gives_the_orms_answer(shared, scenario):
    url, catalog = shared
    run = f"s{list(SCENARIOS).index(scenario)}"
    SCENARIOS[scenario](catalog, run)
    answer = latest_alone(url, run)
    assert answer == orm_answer(catalog, run)
    # and the cases are what they claim to be (an answer, or left to the full lookup)
    expected = ANSWERED.get(scenario)
    assert (answer and answer.step) == (expected and expected.step)
    if answer is not None and answer.step is not None:
        row = catalog.get_checkpoint(run, answer.step)
        assert (answer.path, answer.save_id, row.state) == (row.path, row.save_id, "committed")


@pytest.mark.parametrize("revision", ["0123456789ab", "a0b1c2d3e4f5", None])
def test_a_schema_not_at_head_is_left_to_the_catalog_to_refuse(catalog, catalog_url, revision):
    fresh(catalog, "r")
    assert latest_alone(catalog_url, "r").step == 20
    change = (
        f"UPDATE alembic_version SET version_num = '{revision}'"
        if revision
        else "DELETE FROM alembic_version"
    )
    execute_sql(catalog_url, change)
    assert latest_alone(catalog_url, "r") is None
    if revision:
        with pytest.raises(SchemaOutdatedError):
            Catalog(catalog_url)
    execute_sql(catalog_url, "DELETE FROM alembic_version")
    execute_sql(catalog_url, f"INSERT INTO alembic_version VALUES ('{HEAD_REVISION}')")
    assert latest_alone(catalog_url, "r").step == 20


def test_a_missing_or_empty_sqlite_file_is_left_to_the_catalog(tmp_path):
    missing = tmp_path / "none" / "catalog.db"
    assert latest_alone(f"sqlite:///{missing}", "r") is None
    assert not missing.parent.exists()  # never created by the reader
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    assert latest_alone(f"sqlite:///{empty}", "r") is None
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database" * 100)
    assert latest_alone(f"sqlite:///{garbage}", "r") is None


def test_sqlite_urls_are_read_as_sqlalchemy_reads_them(tmp_path, monkeypatch):
    directory = tmp_path / "a dir%"
    directory.mkdir()
    url = f"sqlite:///{urllib.parse.quote(str(directory / 'c.db'))}"
    with Catalog(url) as catalog:  # SQLAlchemy unquotes the path: the file is "a dir%/c.db"
        fresh(catalog, "r")
    assert (directory / "c.db").exists()
    assert latest_alone(url, "r") == CatalogLatest(20, "memory://ckpt/r/save-20", _save(url, 20))
    monkeypatch.chdir(directory)
    assert latest_alone("sqlite:///c.db", "r").step == 20  # relative to the working directory
    assert latest_alone("sqlite+pysqlite:///c.db", "r").step == 20
    # forms left to SQLAlchemy: a query string, a URI filename, memory
    for other in ("sqlite:///c.db?timeout=5", "sqlite:///file:c.db?uri=true", "sqlite://"):
        assert latest_alone(other, "r") is None


def _save(url: str, step: int) -> str:
    with Catalog(url) as catalog:
        return catalog.get_checkpoint("r", step).save_id


def test_the_lookup_reads_the_index_backwards_and_scans_no_table(catalog_url):
    """The newest committed row is a backward scan of ``(run_id, state, step)`` stopping at its
    first entry, as ``Catalog.latest_committed`` reads it, and the rows above it are an index
    range: no full scan of ``checkpoints``, no sort, on either backend."""
    from sqlalchemy import create_engine, text

    from tests.catalog.test_schema import _populate
    from zephon.catalog.lookup import _LATEST

    Catalog(catalog_url).close()
    _populate(catalog_url, runs=20, per_run=500)
    engine = create_engine(catalog_url)
    try:
        with engine.connect() as connection:
            if engine.dialect.name == "postgresql":
                connection.execute(text("ANALYZE"))
                explain = f"EXPLAIN {_LATEST}"
            else:
                explain = f"EXPLAIN QUERY PLAN {_LATEST}"
            rows = connection.execute(text(explain), {"run": "run-7"}).all()
            plan = "\n".join(str(row[-1]) for row in rows)
    finally:
        engine.dispose()
    assert "ix_checkpoints_run_id_state_step" in plan, plan
    if engine.dialect.name == "postgresql":
        assert "Index Scan Backward using ix_checkpoints_run_id_state_step" in plan, plan
        assert "Sort" not in plan and "Seq Scan on checkpoints" not in plan, plan
    else:
        assert "TEMP B-TREE" not in plan and "SCAN p" not in plan and "SCAN n" not in plan, plan
