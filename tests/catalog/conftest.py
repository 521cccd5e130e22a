"""Catalog test fixtures. ``catalog_url`` and ``catalog`` (tests/conftest.py) run every test
against SQLite (a temporary file) and PostgreSQL (a database of its own per test)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, text

from zephon.catalog import Catalog, schema
from zephon.catalog.engine import Database
from zephon.catalog.models import Base


@pytest.fixture
def run(catalog: Catalog) -> str:
    """A training run named ``r`` with no retention policy."""
    catalog.ensure_run("r", "memory://ckpt/r")
    return "r"


STARTED = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


def commit_step(catalog: Catalog, run: str, step: int, *, epoch: int = 0, **facts) -> None:
    """Begin and commit one checkpoint with plausible facts, as attempt ``epoch``."""
    record = catalog.begin_checkpoint(run, step, f"memory://ckpt/{run}/save-{step}", epoch=epoch)
    catalog.mark_committed(
        run,
        step,
        record.save_id,
        epoch=epoch,
        bytes=facts.get("bytes", 1000 + step),
        file_count=facts.get("file_count", 3),
        manifest_checksum=facts.get("manifest_checksum", f"crc-{step}"),
        metadata=facts.get("metadata"),
    )


def register(catalog: Catalog, run: str, epoch: int, resumed_from: int | None = None, **process):
    """Register attempt ``epoch`` of ``run`` (host ``h<epoch>``, pid ``4000 + epoch``)."""
    return catalog.register_attempt(
        run,
        epoch=epoch,
        attempt_id=process.get("attempt_id", f"{epoch:032x}"),
        host=process.get("host", f"h{epoch}"),
        pid=process.get("pid", 4000 + epoch),
        started_at=process.get("started_at", STARTED),
        resumed_from=resumed_from,
    )


def execute_sql(url: str, *statements: str) -> None:
    """Run raw SQL on ``url`` in one transaction, outside the catalog (a hand edit)."""
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            for statement in statements:
                connection.execute(text(statement))
    finally:
        engine.dispose()


def migrate(url: str, target: str, how=command.upgrade) -> None:
    """Run the installed migrations to ``target`` on ``url``, as ``catalog.schema`` does."""
    db = Database(url)
    try:
        with db.immediate_connection("migrate") as connection:
            config = schema.alembic_config()
            config.attributes["connection"] = connection
            how(config, target)
    finally:
        db.dispose()


def diff_against_models(url: str) -> list:
    """Alembic's ``compare_metadata`` of the database at ``url`` against the ORM models
    (types and server defaults too): empty when the tables are the models'."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"compare_type": True, "compare_server_default": True}
            )
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


def in_threads(work: Callable[[int], None], catalogs: Sequence[Catalog]) -> None:
    """Run ``work(i)`` for each of ``catalogs`` on a thread of its own, wait for them all
    (60 s each at most), then close the catalogs."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(catalogs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for opened in catalogs:
        opened.close()
