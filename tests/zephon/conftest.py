"""Fixtures for the zephon layer (``catalog_url``/``catalog`` on SQLite and PostgreSQL come from
tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import unavailable
from tests.pg_cluster import PostgresCluster
from tests.servers import ServerUnavailable
from zephon.catalog import Catalog
from zephon.cli import main


@pytest.fixture
def sqlite_catalog(tmp_path) -> Iterator[Catalog]:
    with Catalog(f"sqlite:///{tmp_path / 'catalog.db'}") as opened:
        yield opened


def _run_zephon(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors: returned as their code like any other
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cli(catalog_url, capsys):
    """``zephon <command> --catalog <url> ...`` in-process: (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        return _run_zephon([*argv[:1], "--catalog", catalog_url, *argv[1:]], capsys)

    return run


@pytest.fixture
def usage(tmp_path, monkeypatch, capsys):
    """Like ``cli``, for values the parser refuses before any catalog is opened (one SQLite
    catalog then, in case one is: no need to repeat these on PostgreSQL)."""
    monkeypatch.setenv("ZEPHON_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")

    def run(*argv: str) -> tuple[int, str, str]:
        return _run_zephon(list(argv), capsys)

    return run


@pytest.fixture(scope="session")
def own_postgres() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster of the session's own (tests/pg_cluster.py), which tests may stop:
    never the shared server. Fails under CI if it cannot be built, skips elsewhere."""
    try:
        cluster = PostgresCluster()
    except ServerUnavailable as exc:
        unavailable(f"a PostgreSQL cluster of our own: {exc}")
    try:
        yield cluster
    finally:
        cluster.drop()


@dataclass
class StoppableCatalog:
    """A fresh database in ``own_postgres``: its ``url`` and the ``cluster`` to stop."""

    cluster: PostgresCluster
    database: str

    def url(self, password: str | None = None) -> str:
        return self.cluster.url_for(self.database, password)


@pytest.fixture
def stoppable_catalog(own_postgres) -> Iterator[StoppableCatalog]:
    """An empty catalog database on a server the test may stop (running again afterwards)."""
    database = own_postgres.create_database()
    try:
        yield StoppableCatalog(own_postgres, database)
    finally:
        if not own_postgres.running:
            own_postgres.start()
        own_postgres.drop_database(database)
