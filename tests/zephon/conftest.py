"""Fixtures for the zephon layer (``catalog_url``/``catalog`` on SQLite and PostgreSQL come from
tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from catalog import Catalog


@pytest.fixture
def sqlite_catalog(tmp_path) -> Iterator[Catalog]:
    with Catalog(f"sqlite:///{tmp_path / 'catalog.db'}") as opened:
        yield opened
