"""Fixtures for the zephon layer: a catalog on SQLite and PostgreSQL, and runs on storage."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from catalog import Catalog
from tests.catalog.conftest import database_url


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    with database_url(request.param, request, tmp_path) as url:
        yield url


@pytest.fixture
def catalog(catalog_url: str) -> Iterator[Catalog]:
    with Catalog(catalog_url) as opened:
        yield opened


@pytest.fixture
def sqlite_catalog(tmp_path) -> Iterator[Catalog]:
    with Catalog(f"sqlite:///{tmp_path / 'catalog.db'}") as opened:
        yield opened
