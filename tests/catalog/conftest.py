"""Catalog test fixtures. ``catalog_url`` and ``catalog`` (tests/conftest.py) run every test
against SQLite (a temporary file) and PostgreSQL (a database of its own per test)."""

from __future__ import annotations

import pytest

from catalog import Catalog


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
        record.save_id,
        bytes=facts.get("bytes", 1000 + step),
        file_count=facts.get("file_count", 3),
        manifest_checksum=facts.get("manifest_checksum", f"crc-{step}"),
        metadata=facts.get("metadata"),
    )
