"""A read-only ``Catalog`` and the batch reads of dashboards (``catalog/roles/overview.py``),
on SQLite and PostgreSQL: the database refuses writes made through it, nothing is created,
and a page of runs, the saves and the attempts of several runs agree with the per-run
methods."""

from __future__ import annotations

import hashlib
import os

import pytest

from tests.catalog.conftest import STARTED, commit_step
from zephon.catalog import (
    Catalog,
    CatalogError,
    CatalogUnavailableError,
    InvalidValueError,
    SchemaOutdatedError,
)


def _filled(url: str) -> None:
    with Catalog(url) as catalog:
        for index, name in enumerate(["e", "a", "d", "b", "c"]):
            catalog.ensure_run(name, f"memory://ckpt/{name}")
            for step in range(1, index + 2):
                commit_step(catalog, name, step)
        catalog.add_timings("b", 1, catalog.get_checkpoint("b", 1).save_id, {"stall_s": 0.25})
        catalog.update_run("c", status="finished")
        catalog.register_attempt("d", epoch=1, attempt_id="a1", host="h", pid=1, started_at=STARTED)
        catalog.register_attempt("d", epoch=2, attempt_id="a2", host="h", pid=2, started_at=STARTED)


def test_a_read_only_catalog_reads_and_the_database_refuses_its_writes(catalog_url):
    _filled(catalog_url)
    with Catalog(catalog_url, read_only=True) as viewer:
        assert [c.step for c in viewer.list_checkpoints("a")] == [1, 2]
        with pytest.raises(CatalogError):
            viewer.ensure_run("new", "memory://ckpt/new")
        with pytest.raises(CatalogError):
            viewer.pin("a", 1)
    with Catalog(catalog_url) as catalog:
        assert [s.run.name for s in catalog.list_runs()] == ["a", "b", "c", "d", "e"]
        assert not catalog.get_checkpoint("a", 1).pinned


def test_a_read_only_sqlite_catalog_leaves_the_file_byte_identical(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    _filled(url)
    before = hashlib.sha256((tmp_path / "c.db").read_bytes()).hexdigest()
    with Catalog(url, read_only=True) as viewer:
        viewer.run_page()
        viewer.save_rows(["a", "b"])
        with pytest.raises(CatalogUnavailableError, match="readonly|read-only"):
            viewer.ensure_run("new", "memory://ckpt/new")
    assert hashlib.sha256((tmp_path / "c.db").read_bytes()).hexdigest() == before


def test_a_read_only_catalog_creates_nothing(tmp_path, postgres_url):
    missing = tmp_path / "nothing-here" / "c.db"
    with pytest.raises(CatalogUnavailableError, match="unable to open"):
        Catalog(f"sqlite:///{missing}", read_only=True)
    assert not os.path.exists(missing.parent)
    from tests import servers

    with servers.postgres_database(postgres_url) as empty:
        with pytest.raises(SchemaOutdatedError, match="zephon db upgrade"):
            Catalog(empty, read_only=True)
        with Catalog(empty, check_schema=False) as catalog:
            assert catalog.current_revision() is None  # still empty: nothing was created


def test_a_page_of_runs_has_the_aggregates_of_list_runs(catalog_url):
    _filled(catalog_url)
    with Catalog(catalog_url, read_only=True) as viewer:
        every = {s.run.name: s for s in viewer.list_runs()}
        first = viewer.run_page(offset=0, limit=2)
        second = viewer.run_page(offset=2, limit=2)
        last = viewer.run_page(offset=4, limit=2)
        assert (first.total, second.total, last.total) == (5, 5, 5)
        pages = [first.runs, second.runs, last.runs]
        assert [[s.run.name for s in page] for page in pages] == [["a", "b"], ["c", "d"], ["e"]]
        for page in pages:
            for summary in page:
                assert summary == every[summary.run.name]
        finished = viewer.run_page(status="finished")
        assert (finished.total, [s.run.name for s in finished.runs]) == (1, ["c"])
        assert viewer.run_page(offset=10).runs == []


def test_save_rows_and_attempts_of_several_runs_match_the_per_run_reads(catalog_url):
    _filled(catalog_url)
    with Catalog(catalog_url, read_only=True) as viewer:
        rows = viewer.save_rows(["b", "d", "nobody"])
        assert rows["nobody"] == []
        for name in ("b", "d"):
            records = viewer.list_checkpoints(name)
            assert [(r.step, r.epoch) for r in rows[name]] == [(c.step, c.epoch) for c in records]
            for row, record in zip(rows[name], records, strict=True):
                assert abs((row.created_at - record.created_at).total_seconds()) < 0.001
                assert record.committed_at is not None and row.committed_at is not None
                assert abs((row.committed_at - record.committed_at).total_seconds()) < 0.001
        assert [r.stall_s for r in rows["b"]] == [0.25, 0.0, 0.0, 0.0]
        attempts = viewer.attempts_of(["d", "a"])
        assert attempts["a"] == []
        assert attempts["d"] == viewer.list_attempts("d")
        assert [a.epoch for a in attempts["d"]] == [1, 2]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.run_page(limit=0), "limit"),
        (lambda c: c.run_page(limit=501), "limit"),
        (lambda c: c.run_page(offset=-1), "offset"),
        (lambda c: c.run_page(status="paused"), "status"),
        (lambda c: c.save_rows(["bad name"]), "run name"),
        (lambda c: c.attempts_of([f"r{i}" for i in range(501)]), "number of runs"),
    ],
)
def test_bad_arguments_are_refused_before_any_query(tmp_path, call, message):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    Catalog(url).close()
    with Catalog(url, read_only=True) as viewer, pytest.raises(InvalidValueError, match=message):
        call(viewer)


def test_a_timeline_has_what_the_full_records_say(catalog_url):
    _filled(catalog_url)
    with Catalog(catalog_url) as catalog:
        catalog.replica_started("c", 2, tier="local", host="n1", location="/l/c/2", save_id="s2")
        catalog.replica_committed("c", 2, tier="local", host="n1", save_id="s2", bytes=5)
        catalog.pin("c", 3)
    with Catalog(catalog_url, read_only=True) as viewer:
        rows, copies = viewer.timeline("c")
        records = viewer.list_checkpoints("c")
        assert [r.step for r in rows] == [r.step for r in records] == [1, 2, 3, 4, 5]
        for row, record in zip(rows, records, strict=True):
            assert (row.state, row.epoch, row.pinned, row.bytes) == (
                record.state,
                record.epoch,
                record.pinned,
                record.bytes,
            )
            assert abs((row.created_at - record.created_at).total_seconds()) < 0.001
            assert row.timings == (record.timings or {})
        assert [(c.step, c.tier, c.host, c.state) for c in copies] == [
            (r.step, r.tier, r.host, r.state) for r in viewer.replicas("c")
        ]
        assert copies and copies[0].committed_at is not None
        later = rows[2].created_at
        since, _ = viewer.timeline("c", since=later, states=["committed"])
        assert [r.step for r in since] == [3, 4, 5]
        assert viewer.timeline("c", until=rows[0].created_at)[0][0].step == 1
        with pytest.raises(InvalidValueError, match="since"):
            viewer.timeline("c", since=later.replace(tzinfo=None))
