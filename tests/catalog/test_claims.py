"""Deletion claims: re-checked against the current rows, leases, tokens, expired claims."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.catalog.conftest import commit_step, register
from zephon.catalog import FencedOutError, InvalidValueError, RunNotFoundError, claim_holder


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


def test_a_released_claim_is_taken_over_at_once_whatever_the_lease(catalog, kept2):
    failed, other = catalog.claim_for_deletion(kept2, [1]), catalog.claim_for_deletion(kept2, [2])
    token = failed[0].claimed_by
    assert catalog.release_claims(kept2, [token], "the delete failed: PermissionError") == [1]
    assert catalog.release_claims(kept2, [token], "again") == []  # nothing left to release
    row = catalog.get_checkpoint(kept2, 1)
    assert (row.state, row.claimed_by, row.claimed_at) == ("deleting", token, None)
    event = catalog.events(run=kept2)[0]
    assert (event.action, event.step) == ("released", 1)
    assert event.detail == {"claim": token, "reason": "the delete failed: PermissionError"}

    lease = timedelta(days=3650)  # the longest lease: a released claim is over all the same
    assert [c.step for c in catalog.expired_claims(run=kept2, lease=lease)] == [1]
    [taken] = catalog.claim_for_deletion(kept2, [1, 2], lease=lease)
    assert taken.step == 1 and taken.claimed_by != token and taken.claimed_at is not None
    assert catalog.events(run=kept2)[0].action == "reclaimed"
    assert not catalog.mark_deleted(kept2, 1, token)
    assert catalog.mark_deleted(kept2, 1, taken.claimed_by)
    # the other claim, of another token, was never touched
    assert catalog.get_checkpoint(kept2, 2).claimed_by == other[0].claimed_by
    assert catalog.release_claims(kept2, [], "nothing") == []


def test_the_claim_token_names_its_process_only_for_the_default_actor(catalog, kept2):
    [claimed] = catalog.claim_for_deletion(kept2, [1])
    assert claim_holder(claimed.claimed_by) == (socket.gethostname(), os.getpid())
    assert claim_holder("nightly-gc/0123456789ab") is None
    assert claim_holder("u@h:12/0123456789ab") == ("h", 12)
    assert claim_holder("u@h:12") is None and claim_holder("u@h:x/0123456789ab") is None


def test_claim_arguments_are_checked(catalog, kept2):
    with pytest.raises(InvalidValueError, match="lease"):
        catalog.claim_for_deletion(kept2, [1], lease=timedelta(0))
    with pytest.raises(InvalidValueError, match="grace"):
        catalog.claim_for_deletion(kept2, [1], grace=timedelta(seconds=-1))
    with pytest.raises(InvalidValueError, match="epoch"):
        catalog.claim_for_deletion(kept2, [1], epoch=-1)
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


def test_a_jobs_own_claim_with_a_superseded_epoch_is_refused_and_claims_nothing(catalog, kept2):
    register(catalog, kept2, 1, resumed_from=6)
    register(catalog, kept2, 2, resumed_from=6, host="h2", pid=77)
    with pytest.raises(FencedOutError, match="host h2, pid 77") as caught:
        catalog.claim_for_deletion(kept2, [1, 2, 3, 4], epoch=1)
    assert caught.value.current.epoch == 2
    assert set(_states(catalog).values()) == {"committed"}
    assert [c.step for c in catalog.claim_for_deletion(kept2, [1, 2], epoch=2)] == [1, 2]


def test_the_current_attempts_resume_point_is_never_claimed(catalog, kept2):
    register(catalog, kept2, 1, resumed_from=2)  # an old step: 3..6 are abandoned
    assert _states(catalog) == {1: "committed", 2: "committed"} | dict.fromkeys(
        (3, 4, 5, 6), "stale"
    )
    plan = catalog.retention_plan(kept2, grace=timedelta(0))
    assert 2 not in plan.to_delete
    assert "resume point of the current attempt (epoch 1)" in plan.decisions[1].reason
    won = catalog.claim_for_deletion(kept2, [1, 2, 3, 4, 5, 6], grace=timedelta(0))
    assert [c.step for c in won] == [3, 4, 5, 6]  # 1 and 2: the only committed rows
    catalog.update_run(kept2, num_to_keep=1)
    assert catalog.claim_for_deletion(kept2, [2], grace=timedelta(0)) == []
    # once the attempt committed a checkpoint of its own, the policy decides about step 2
    commit_step(catalog, kept2, 7, epoch=1)
    commit_step(catalog, kept2, 8, epoch=1)
    won = catalog.claim_for_deletion(kept2, [1, 2, 7], grace=timedelta(0))
    assert [c.step for c in won] == [1, 2, 7]


def test_stale_rows_are_claimed_only_once_the_grace_has_passed(catalog, kept2):
    start = datetime.now(UTC)
    register(catalog, kept2, 1, resumed_from=4)  # 5 and 6 are abandoned
    assert catalog.retention_plan(kept2).to_delete == [1, 2]  # 3 and 4: the 2 newest committed
    assert [c.step for c in catalog.claim_for_deletion(kept2, [5, 6])] == []
    later = start + timedelta(hours=25)
    assert catalog.retention_plan(kept2, now=later).to_delete == [1, 2, 5, 6]
    won = catalog.claim_for_deletion(kept2, [5, 6], now=later)
    assert [(c.step, c.state) for c in won] == [(5, "deleting"), (6, "deleting")]
    assert catalog.events(run=kept2)[0].detail["from"] == "stale"
    assert catalog.mark_deleted(kept2, 5, won[0].claimed_by)
    assert catalog.get_checkpoint(kept2, 5).failure_reason.startswith("abandoned: attempt")


def test_corrupt_rows_are_kept_until_their_deletion_is_asked_for(catalog, kept2):
    assert catalog.mark_corrupt(kept2, 6, catalog.get_checkpoint(kept2, 6).save_id, "bad crc")
    # Corrupt rows do not count: 4 and 5 are now the 2 newest committed.
    assert catalog.retention_plan(kept2).to_delete == [1, 2, 3]
    assert [c.step for c in catalog.claim_for_deletion(kept2, [6])] == []
    assert catalog.retention_plan(kept2, corrupt=True).to_delete == [1, 2, 3, 6]
    [won] = catalog.claim_for_deletion(kept2, [6], corrupt=True)
    assert won.step == 6 and won.failure_reason == "bad crc"


def test_a_zero_grace_never_expires_a_pending_row_younger_than_the_pending_grace(catalog, kept2):
    catalog.begin_checkpoint(kept2, 7, "/c/r/7")
    start = datetime.now(UTC)
    plan = catalog.retention_plan(kept2, grace=timedelta(0), now=start + timedelta(hours=1))
    assert plan.to_expire == []
    plan = catalog.retention_plan(kept2, grace=timedelta(0), now=start + timedelta(hours=25))
    assert [d.step for d in plan.to_expire] == [7]
    short = catalog.retention_plan(
        kept2, pending_grace=timedelta(minutes=30), now=start + timedelta(hours=1)
    )
    assert [d.step for d in short.to_expire] == [7]
    assert catalog.claim_for_deletion(kept2, [7], grace=timedelta(0)) == []  # never claimed


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


def test_a_requested_claim_takes_what_the_policy_keeps_but_pins_and_the_resume_point(catalog):
    # Lightning's save_top_k asks for steps the policy keeps (here: keep all): they are
    # claimed, except a pinned one and the current attempt's only footing
    catalog.ensure_run("k", "/c/k")
    for step in range(1, 7):
        commit_step(catalog, "k", step)
    register(catalog, "k", 1, resumed_from=5)  # 6 is abandoned
    catalog.pin("k", 4)
    catalog.begin_checkpoint("k", 7, "/c/k/7", epoch=1)
    assert catalog.claim_for_deletion("k", [3, 4, 5], epoch=1) == []  # the plan keeps them
    won = catalog.claim_for_deletion("k", [3, 4, 5, 6, 7, 99], epoch=1, requested=True)
    assert [c.step for c in won] == [3, 6]  # 4 pinned, 5 the resume point, 7 pending
    with pytest.raises(FencedOutError):
        catalog.claim_for_deletion("k", [1], epoch=0, requested=True)
    commit_step(catalog, "k", 8, epoch=1)  # the attempt stands on a checkpoint of its own
    assert [c.step for c in catalog.claim_for_deletion("k", [5], requested=True)] == [5]


def test_a_plan_lists_the_steps_being_deleted_and_decides_nothing_about_them(catalog, kept2):
    assert catalog.retention_plan(kept2).held == ()
    won = catalog.claim_for_deletion(kept2, [1, 3])
    assert [c.step for c in won] == [1, 3]
    plan = catalog.retention_plan(kept2)
    assert plan.held == (1, 3)  # gc judges their holders from this same read
    assert plan.to_delete == [2, 4]
    assert 1 not in {d.step for d in plan.decisions} and 3 not in {d.step for d in plan.decisions}
    catalog.mark_deleted(kept2, 1, won[0].claimed_by)
    assert catalog.retention_plan(kept2).held == (3,)
