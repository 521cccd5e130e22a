"""Fixtures shared by the DCP tests."""

from __future__ import annotations

import pytest

from zephon.dcp import writer as dcp_writer


@pytest.fixture
def parallel_shards(monkeypatch):
    """Tiny test states written as if they were large: ``thread_count`` shard files in parallel
    threads, not the one file a save under ``SMALL_PLAN_BYTES`` gets, for tests about
    several files."""
    monkeypatch.setattr(dcp_writer, "SMALL_PLAN_BYTES", 0)
