"""Catalog test fixtures: every test runs against SQLite (a temporary file) and PostgreSQL.

Each PostgreSQL test gets a database of its own (``zephon_cat_<random>``), dropped afterwards:
other people run tests on the same server at the same time, so nothing shared is ever touched.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import make_url

from catalog import Catalog

BACKENDS = ["sqlite", "postgresql"]


def _libpq_dsn(url: str, database: str | None = None) -> str:
    parsed = make_url(url).set(drivername="postgresql")
    if database is not None:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)


@contextlib.contextmanager
def postgres_database(server_url: str, prefix: str = "zephon_cat") -> Iterator[str]:
    """A new, empty database on the server of ``server_url``; yields its SQLAlchemy URL."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq_dsn(server_url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(_libpq_dsn(server_url), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def database_url(backend: str, request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / f'catalog-{uuid.uuid4().hex[:8]}.db'}"
        return
    server = request.getfixturevalue("postgres_url")
    with postgres_database(server) as url:
        yield url


@pytest.fixture(params=BACKENDS)
def catalog_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """The URL of a fresh, empty catalog database on each backend in turn."""
    with database_url(request.param, request, tmp_path) as url:
        yield url


@pytest.fixture
def catalog(catalog_url: str) -> Iterator[Catalog]:
    """An open catalog at schema head on each backend in turn."""
    with Catalog(catalog_url) as opened:
        yield opened


@pytest.fixture
def run(catalog: Catalog) -> str:
    """A training run named ``r`` with no retention policy."""
    catalog.ensure_run("r", "memory://ckpt/r")
    return "r"


def commit_step(catalog: Catalog, run: str, step: int, **facts) -> None:
    """Begin and commit one checkpoint with plausible facts."""
    record = catalog.begin_checkpoint(run, step, f"memory://ckpt/{run}/save-{step}")
    catalog.mark_committed(
        run,
        step,
        record.attempt_id,
        bytes=facts.get("bytes", 1000 + step),
        file_count=facts.get("file_count", 3),
        manifest_checksum=facts.get("manifest_checksum", f"crc-{step}"),
        metadata=facts.get("metadata"),
    )
