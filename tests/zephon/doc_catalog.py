"""docs/catalog.md's SQL and error messages, produced by a real catalog.

The SQL runs as printed (its ``:name`` parameters bound) on SQLite and on PostgreSQL, in a
catalog holding a run with committed checkpoints; each message shown is the ``str()`` of the
error the catalog raises for the input the page describes.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.conftest import database_url
from tests.zephon.doc_blocks import Block


def _catalog_with_checkpoints(url: str):
    from zephon.catalog import Catalog

    cat = Catalog(url)
    cat.ensure_run("r", "/ckpt")
    for step in (10, 20, 30):
        row = cat.begin_checkpoint("r", step, f"/ckpt/r/save-{step}")
        cat.mark_committed("r", step, row.save_id, bytes=1, file_count=1, manifest_checksum="c")
    return cat


def _execute(url: str, sql: str, params: dict):
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            result = connection.execute(sa.text(sql), params)
            return result.fetchall() if result.returns_rows else result.rowcount
    finally:
        engine.dispose()


def check_sql(doc: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    for backend in ("sqlite", "postgresql"):
        with database_url(backend, request, tmp_path) as url:
            _catalog_with_checkpoints(url).close()
            if doc.code.startswith("SELECT"):
                rows = _execute(url, doc.code, {"run": "r"})
                assert [tuple(row)[:1] for row in rows] == [(30,)], (backend, rows)
            else:
                from zephon.catalog import Catalog

                with Catalog(url) as cat:
                    before = len(cat.events(run=None, limit=1000))
                cutoff = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
                deleted = _execute(url, doc.code, {"cutoff": cutoff, "n": 2})
                with Catalog(url) as cat:
                    after = len(cat.events(run=None, limit=1000))
                assert (deleted, before - after) == (2, 2), backend


def _raised(action) -> str:
    from zephon.catalog import CatalogError

    with pytest.raises(CatalogError) as caught:
        action()
    return str(caught.value)


def check_message(doc: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    from zephon.catalog import Catalog

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog(url) as cat:
        if doc.code.startswith("invalid num_to_keep"):
            message = _raised(lambda: cat.ensure_run("r", "/ckpt", num_to_keep=10**30))
        elif doc.code.startswith("invalid timings phase"):
            cat.ensure_run("r", "/ckpt")
            row = cat.begin_checkpoint("r", 1, "/ckpt/r/save-1")
            message = _raised(lambda: cat.add_timings("r", 1, row.save_id, {"write": 1.0}))
        else:
            cat.ensure_run("r1", "/ckpt")
            started = dt.datetime(2026, 12, 1, 10, tzinfo=dt.UTC)
            for epoch in (3, 5):
                cat.register_attempt(
                    "r1", epoch=epoch, attempt_id=f"a{epoch}", host="h1", pid=4242,
                    started_at=started, resumed_from=None,
                )  # fmt: skip
            message = _raised(lambda: cat.begin_checkpoint("r1", 7, "/ckpt/r1/save-7", epoch=3))
            message = message.replace(url, "sqlite:///...")
    assert message == " ".join(doc.code.split())


def check(doc: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if doc.lang == "sql":
        check_sql(doc, request, tmp_path)
    else:
        check_message(doc, request, tmp_path)
