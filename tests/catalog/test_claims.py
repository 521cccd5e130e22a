"""Deletion claims: re-checked against the current rows, leases, tokens, expired claims."""

from __future__ import annotations

import contextlib
import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from catalog import InvalidValueError, RunNotFoundError
from tests.catalog.conftest import commit_step


@pytest.fixture
def kept2(catalog):
    """Run ``r`` keeping 2, with committed steps 1..6."""
    catalog.ensure_run("r", "/c/r", num_to_keep=2)
    for step in range(1, 7):
        commit_step(catalog, "r", step)
    return "r"


def _states(catalog, run="r"):
    return {c.step: c.state for c in catalog.list_checkpoints(run)}


def test_claim_then_mark_deleted(catalog, kept2):
    plan = catalog.retention_plan(kept2)
    assert plan.to_delete == [1, 2, 3, 4]
    won = catalog.claim_for_deletion(kept2, plan.to_delete)
    assert [c.step for c in won] == [1, 2, 3, 4]
    token = won[0].claimed_by
    assert all(c.state == "deleting" and c.claimed_by == token for c in won)
    assert won[0].claimed_at.tzinfo == UTC
    for claimed in won:
        assert catalog.mark_deleted(kept2, claimed.step, claimed.claimed_by)
    assert not catalog.mark_deleted(kept2, 1, token)  # already done
    assert _states(catalog) == {
        1: "deleted",
        2: "deleted",
        3: "deleted",
        4: "deleted",
        5: "committed",
        6: "committed",
    }
    actions = [e.action for e in reversed(catalog.events(run=kept2))]
    assert actions.count("claimed") == 4 and actions.count("deleted") == 4


def test_claim_never_takes_what_the_current_policy_keeps(catalog, kept2):
    catalog.begin_checkpoint(kept2, 7, "/c/r/7")
    # Asking for everything, including the newest, the newest 2, and a pending row.
    won = catalog.claim_for_deletion(kept2, [1, 2, 3, 4, 5, 6, 7, 99])
    assert [c.step for c in won] == [1, 2, 3, 4]
    assert _states(catalog)[7] == "pending"


def test_a_pin_or_policy_change_after_planning_is_respected(catalog, kept2):
    plan = catalog.retention_plan(kept2)
    catalog.pin(kept2, 2)
    catalog.update_run(kept2, num_to_keep=3, keep_every_steps=3)
    won = catalog.claim_for_deletion(kept2, plan.to_delete)
    assert [c.step for c in won] == [1]  # 2 pinned, 3 milestone, 4 now among newest 3


def test_a_commit_after_planning_can_only_free_more(catalog, kept2):
    plan = catalog.retention_plan(kept2)
    commit_step(catalog, kept2, 7)
    won = catalog.claim_for_deletion(kept2, [*plan.to_delete, 5])
    assert [c.step for c in won] == [1, 2, 3, 4, 5]


def test_rows_claimed_by_someone_else_are_not_claimed_again(catalog, kept2):
    first = catalog.claim_for_deletion(kept2, [1, 2])
    second = catalog.claim_for_deletion(kept2, [1, 2, 3])
    assert [c.step for c in first] == [1, 2]
    assert [c.step for c in second] == [3]
    assert first[0].claimed_by != second[0].claimed_by
    assert not catalog.mark_deleted(kept2, 1, second[0].claimed_by)  # wrong token


def test_an_expired_lease_is_reclaimed_and_the_old_claim_cannot_finish(catalog, kept2):
    start = datetime.now(UTC)
    [crashed] = catalog.claim_for_deletion(kept2, [1], now=start)
    lease = timedelta(hours=1)
    assert catalog.expired_claims(lease=lease, now=start + timedelta(minutes=59)) == []
    later = start + timedelta(hours=2)
    [expired] = catalog.expired_claims(lease=lease, now=later)
    assert (expired.run, expired.step, expired.claimed_by) == (kept2, 1, crashed.claimed_by)
    assert [c.step for c in catalog.expired_claims(run=kept2, lease=lease, now=later)] == [1]

    # Not expired yet: nobody else may take it.
    assert catalog.claim_for_deletion(kept2, [1], now=start + timedelta(minutes=30)) == []
    [taken] = catalog.claim_for_deletion(kept2, [1], lease=lease, now=later)
    assert taken.claimed_by != crashed.claimed_by and taken.claimed_at == later
    assert catalog.events(run=kept2)[0].action == "reclaimed"
    assert not catalog.mark_deleted(kept2, 1, crashed.claimed_by)
    assert catalog.mark_deleted(kept2, 1, taken.claimed_by)


def test_claim_arguments_are_checked(catalog, kept2):
    with pytest.raises(InvalidValueError, match="lease"):
        catalog.claim_for_deletion(kept2, [1], lease=timedelta(0))
    with pytest.raises(InvalidValueError, match="step"):
        catalog.claim_for_deletion(kept2, [-1])
    with pytest.raises(RunNotFoundError):
        catalog.claim_for_deletion("ghost", [1])
    assert catalog.claim_for_deletion(kept2, []) == []


def test_a_run_keeping_everything_yields_no_claims(catalog, run):
    for step in range(5):
        commit_step(catalog, run, step)
    assert catalog.retention_plan(run).to_delete == []
    assert catalog.claim_for_deletion(run, [0, 1, 2]) == []


@contextlib.contextmanager
def _lock_held_by_a_claim(url: str, dialect: str):
    """Hold what a claim in flight holds: the run row FOR SHARE, or SQLite's write lock."""
    if dialect == "sqlite":
        import sqlite3

        connection = sqlite3.connect(make_url(url).database, isolation_level=None)
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            connection.execute("ROLLBACK")
            connection.close()
        return
    engine = create_engine(url)
    try:
        with engine.connect() as connection, connection.begin():
            connection.execute(text("SELECT id FROM runs WHERE name = 'r' FOR SHARE"))
            yield
    finally:
        engine.dispose()


def test_policy_changes_wait_for_a_claim_in_flight(catalog, kept2, catalog_url):
    done = threading.Event()
    worker = threading.Thread(target=lambda: (catalog.update_run(kept2, num_to_keep=5), done.set()))
    with _lock_held_by_a_claim(catalog_url, catalog.dialect):
        worker.start()
        assert not done.wait(0.5), "update_run did not wait for the claim's lock"
        if catalog.dialect == "postgresql":
            # New checkpoints only need a key-share lock on their run: claims never block them.
            commit_step(catalog, kept2, 7)
    worker.join(30)
    assert done.is_set()
    assert catalog.get_run(kept2).num_to_keep == 5
