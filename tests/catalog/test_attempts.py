"""Attempts and fencing: registration order, abandonment of older lineages, and every fenced
call refusing an epoch that is not the current one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.catalog.conftest import STARTED, commit_step, register
from zephon.catalog import (
    AttemptRecord,
    FencedOutError,
    InvalidTransitionError,
    InvalidValueError,
    RunNotFoundError,
    StateConflictError,
    attempts,
)


def _states(catalog, run="r"):
    return {c.step: c.state for c in catalog.list_checkpoints(run)}


def test_a_run_starts_unfenced_and_each_registered_attempt_becomes_current(catalog, run):
    assert catalog.get_run(run).epoch == 0
    assert catalog.current_attempt(run) is None and catalog.list_attempts(run) == []

    first = register(catalog, run, 1)
    assert first.abandoned == () and first.attempt.resumed_from is None
    registration = register(catalog, run, 3, resumed_from=10, host="h1", pid=4242)
    attempt = registration.attempt
    assert isinstance(attempt, AttemptRecord)
    assert (attempt.run, attempt.epoch, attempt.host, attempt.pid) == (run, 3, "h1", 4242)
    assert (attempt.attempt_id, attempt.started_at, attempt.resumed_from) == (
        f"{3:032x}",
        STARTED,
        10,
    )
    assert attempt.registered_at.tzinfo == UTC
    assert catalog.get_run(run).epoch == 3
    assert catalog.current_attempt(run) == attempt
    assert [a.epoch for a in catalog.list_attempts(run)] == [1, 3]

    event = catalog.events(run=run)[0]
    assert event.action == "attempt_registered"
    assert event.detail == {
        "epoch": 3,
        "attempt_id": f"{3:032x}",
        "host": "h1",
        "pid": 4242,
        "started_at": STARTED.isoformat(),
        "resumed_from": 10,
        "abandoned": [],
    }
    assert registration.to_dict()["abandoned"] == []


def test_an_attempt_not_newer_than_the_current_one_is_refused_naming_it(catalog, run):
    register(catalog, run, 5, host="h1", pid=4242)
    for epoch in (3, 5):
        with pytest.raises(FencedOutError) as caught:
            register(catalog, run, epoch, attempt_id="someone-else")
        error = caught.value
        assert (error.run, error.epoch, error.current.epoch) == (run, epoch, 5)
        assert error.url == catalog.url
        assert "host h1, pid 4242, started 2026-12-01T10:00:00+00:00" in str(error)
        assert "stop saving" in str(error)
    assert str(caught.value).startswith(f"run 'r' in catalog {catalog.url}: attempt epoch 5")
    with pytest.raises(FencedOutError) as caught:
        register(catalog, run, 3)
    assert (
        "attempt epoch 3 is no longer current: attempt epoch 5 (host h1, pid 4242, started "
        "2026-12-01T10:00:00+00:00) took over; this process is a stale attempt (a preempted "
        "job still running?): stop saving"
    ) in str(caught.value)
    assert [a.epoch for a in catalog.list_attempts(run)] == [5]
    assert [e.action for e in catalog.events(run=run)].count("attempt_registered") == 1


def test_registering_the_current_attempt_again_changes_nothing(catalog, run):
    commit_step(catalog, run, 30)
    first = register(catalog, run, 2, resumed_from=10)
    assert first.abandoned == (30,)
    again = register(catalog, run, 2, resumed_from=10)
    assert again.attempt == first.attempt and again.abandoned == ()
    assert [e.action for e in catalog.events(run=run)].count("attempt_registered") == 1


def test_registration_abandons_older_rows_above_the_resume_point(catalog, run):
    for step in (10, 20, 30, 35):
        commit_step(catalog, run, step)
    failed = catalog.begin_checkpoint(run, 25, "/c/25")
    catalog.mark_failed(run, 25, failed.save_id, "disk full")
    catalog.begin_checkpoint(run, 40, "/c/40")
    catalog.mark_missing(run, 35)

    registration = register(catalog, run, 1, resumed_from=20)

    assert registration.abandoned == (25, 30, 40)
    assert _states(catalog) == {
        10: "committed",
        20: "committed",  # the resume point itself stays
        25: "stale",
        30: "stale",
        35: "deleted",  # gc's or sync's: not part of any lineage any more
        40: "stale",
    }
    for step in registration.abandoned:
        row = catalog.get_checkpoint(run, step)
        assert row.failure_reason == "abandoned: attempt epoch 1 resumed from step 20"
    assert catalog.latest_committed(run).step == 20
    assert catalog.events(run=run)[0].detail["abandoned"] == [25, 30, 40]


def test_a_fresh_start_abandons_every_older_step(catalog, run):
    commit_step(catalog, run, 0)
    commit_step(catalog, run, 10)
    registration = register(catalog, run, 1, resumed_from=None)
    assert registration.abandoned == (0, 10)
    reason = catalog.get_checkpoint(run, 0).failure_reason
    assert reason == "abandoned: attempt epoch 1 started fresh"
    assert catalog.latest_committed(run) is None


def test_only_older_attempts_rows_are_abandoned_and_the_resume_step_stays(catalog, run):
    register(catalog, run, 1)
    commit_step(catalog, run, 30, epoch=1)
    commit_step(catalog, run, 40, epoch=1)
    registration = register(catalog, run, 2, resumed_from=30)
    assert registration.abandoned == (40,)
    commit_step(catalog, run, 40, epoch=2)  # the new attempt saves the step again
    commit_step(catalog, run, 50, epoch=2)
    assert register(catalog, run, 3, resumed_from=50).abandoned == ()
    assert catalog.get_checkpoint(run, 40).epoch == 2
    assert _states(catalog) == {30: "committed", 40: "committed", 50: "committed"}


def test_a_failed_abandonment_rolls_the_whole_registration_back(catalog, run, monkeypatch):
    commit_step(catalog, run, 30)

    def broken(*args, **kwargs):
        raise RuntimeError("crash in the middle of the registration")

    monkeypatch.setattr(attempts, "_abandon", broken)
    with pytest.raises(RuntimeError):
        register(catalog, run, 1, resumed_from=10)
    assert catalog.get_run(run).epoch == 0 and catalog.list_attempts(run) == []
    assert _states(catalog) == {30: "committed"}


def _fenced_calls(catalog, run):
    """Every fenced call, as ``name -> call(epoch)``; step 6 is pending, begun by epoch 2."""
    return {
        "begin_checkpoint": lambda epoch: catalog.begin_checkpoint(run, 7, "/c/7", epoch=epoch),
        "mark_committed": lambda epoch: catalog.mark_committed(
            run,
            6,
            catalog.get_checkpoint(run, 6).save_id,
            epoch=epoch,
            bytes=1,
            file_count=1,
            manifest_checksum=None,
        ),
        "update_run": lambda epoch: catalog.update_run(run, status="finished", epoch=epoch),
        "claim_for_deletion": lambda epoch: catalog.claim_for_deletion(run, [1], epoch=epoch),
    }


@pytest.mark.parametrize(
    "call", ["begin_checkpoint", "mark_committed", "update_run", "claim_for_deletion"]
)
def test_every_fenced_call_refuses_a_superseded_epoch_naming_the_current_attempt(catalog, call):
    catalog.ensure_run("r", "/c", num_to_keep=1)
    register(catalog, "r", 1)
    for step in (1, 2, 3):
        commit_step(catalog, "r", step, epoch=1)
    register(catalog, "r", 2, resumed_from=3, host="h1", pid=4242)
    catalog.begin_checkpoint("r", 6, "/c/6", epoch=2)
    before = (_states(catalog), catalog.get_run("r"))

    for stale_epoch in (0, 1):
        with pytest.raises(FencedOutError) as caught:
            _fenced_calls(catalog, "r")[call](stale_epoch)
        error = caught.value
        assert (error.run, error.epoch, error.current.epoch) == ("r", stale_epoch, 2)
        message = str(error)
        assert f"attempt epoch {stale_epoch} is no longer current: attempt epoch 2" in message
        assert "host h1, pid 4242, started 2026-12-01T10:00:00+00:00" in message
        assert "stop saving" in message
    assert (_states(catalog), catalog.get_run("r")) == before

    _fenced_calls(catalog, "r")[call](2)  # the current attempt passes


def test_an_epoch_that_was_never_registered_is_refused(catalog, run):
    with pytest.raises(FencedOutError, match="the run has no fenced attempt yet") as caught:
        catalog.begin_checkpoint(run, 1, "/c/1", epoch=1)
    assert caught.value.current is None
    register(catalog, run, 1)
    with pytest.raises(FencedOutError, match="attempt epoch 4 is not registered") as caught:
        catalog.begin_checkpoint(run, 1, "/c/1", epoch=4)
    assert caught.value.current.epoch == 1 and "register_attempt" in str(caught.value)


def test_epoch_zero_works_only_while_the_run_was_never_fenced(catalog, run):
    commit_step(catalog, run, 1)  # unfenced, as before fencing existed
    assert catalog.get_checkpoint(run, 1).epoch == 0
    register(catalog, run, 1, resumed_from=1)
    with pytest.raises(FencedOutError):
        catalog.begin_checkpoint(run, 2, "/c/2")
    assert catalog.begin_checkpoint(run, 2, "/c/2", epoch=1).epoch == 1


def test_mark_committed_stays_idempotent_for_its_save_after_a_newer_attempt_registered(
    catalog, run
):
    register(catalog, run, 1)
    begun = catalog.begin_checkpoint(run, 10, "/c/10", epoch=1)
    facts = {"bytes": 1, "file_count": 1, "manifest_checksum": "m"}
    first = catalog.mark_committed(run, 10, begun.save_id, epoch=1, **facts)
    register(catalog, run, 2, resumed_from=10)
    # A retry of a commit that happened while epoch 1 was current: not an error.
    assert catalog.mark_committed(run, 10, begun.save_id, epoch=1, **facts) == first
    assert [e.action for e in catalog.events(run=run)].count("committed") == 1


def test_an_old_attempts_save_at_or_below_the_resume_point_cannot_be_committed(catalog, run):
    register(catalog, run, 1)
    begun = catalog.begin_checkpoint(run, 5, "/c/5", epoch=1)
    register(catalog, run, 2, resumed_from=10)
    assert catalog.get_checkpoint(run, 5).state == "pending"  # not abandoned: below 10
    with pytest.raises(FencedOutError):
        catalog.mark_committed(
            run, 5, begun.save_id, epoch=1, bytes=1, file_count=1, manifest_checksum=None
        )
    assert catalog.get_checkpoint(run, 5).state == "pending"
    # Nor by the new attempt: only the attempt that began a save commits it.
    with pytest.raises(InvalidTransitionError, match="begun by attempt epoch 1"):
        catalog.mark_committed(
            run, 5, begun.save_id, epoch=2, bytes=1, file_count=1, manifest_checksum=None
        )


def test_an_abandoned_pending_row_can_be_neither_committed_nor_failed(catalog, run):
    register(catalog, run, 1)
    begun = catalog.begin_checkpoint(run, 30, "/c/30", epoch=1)
    register(catalog, run, 2, resumed_from=20)
    with pytest.raises(FencedOutError):
        catalog.mark_committed(
            run, 30, begun.save_id, epoch=1, bytes=1, file_count=1, manifest_checksum=None
        )
    with pytest.raises(StateConflictError) as caught:
        catalog.mark_failed(run, 30, begun.save_id, "late failure report")  # not fenced
    assert caught.value.state == "stale"
    assert catalog.get_checkpoint(run, 30).state == "stale"


@pytest.mark.parametrize("previous", ["stale", "corrupt"])
def test_stale_and_corrupt_rows_are_re_armed_by_a_new_save(catalog, run, previous):
    register(catalog, run, 1)
    commit_step(catalog, run, 30, epoch=1)
    old = catalog.get_checkpoint(run, 30)
    if previous == "stale":
        register(catalog, run, 2, resumed_from=20)
        epoch = 2
    else:
        assert catalog.mark_corrupt(run, 30, old.save_id, "crc mismatch in part-001")
        epoch = 1
    assert catalog.get_checkpoint(run, 30).state == previous

    new = catalog.begin_checkpoint(run, 30, "/c/30-again", epoch=epoch, save_id="save-2")
    assert (new.state, new.save_id, new.epoch, new.failure_reason) == (
        "pending",
        "save-2",
        epoch,
        None,
    )
    rearmed = catalog.events(run=run)[0]
    assert rearmed.action == "rearmed"
    assert rearmed.detail["previous"]["state"] == previous
    assert rearmed.detail["previous"]["save_id"] == old.save_id
    assert rearmed.detail["previous"]["epoch"] == 1


@pytest.mark.parametrize("save_id", ["", "x" * 65, "has space", "a/b", 7])
def test_a_malformed_save_id_is_refused(catalog, run, save_id):
    with pytest.raises(InvalidValueError, match="save_id"):
        catalog.begin_checkpoint(run, 1, "/c/1", save_id=save_id)


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("epoch", 0),
        ("epoch", True),
        ("attempt_id", "not a uuid!"),
        ("host", ""),
        ("pid", -1),
        ("started_at", datetime(2026, 12, 1)),
        ("resumed_from", -1),
    ],
)
def test_register_attempt_arguments_are_checked(catalog, run, argument, value):
    arguments = {
        "epoch": 1,
        "attempt_id": "a" * 32,
        "host": "h",
        "pid": 1,
        "started_at": STARTED,
        "resumed_from": None,
        argument: value,
    }
    with pytest.raises(InvalidValueError, match=argument):
        catalog.register_attempt(run, **arguments)


def test_attempts_of_an_unknown_run_name_it(catalog):
    with pytest.raises(RunNotFoundError):
        register(catalog, "ghost", 1)
    with pytest.raises(RunNotFoundError):
        catalog.current_attempt("ghost")


def test_mark_corrupt_takes_the_row_out_of_latest_and_keeps_it_for_inspection(catalog, run):
    commit_step(catalog, run, 10)
    commit_step(catalog, run, 20)
    row = catalog.get_checkpoint(run, 20)
    assert not catalog.mark_corrupt(run, 20, "another-save", "crc mismatch")
    assert catalog.mark_corrupt(run, 20, row.save_id, "crc mismatch in part-003")
    assert not catalog.mark_corrupt(run, 20, row.save_id, "again")  # already corrupt
    corrupt = catalog.get_checkpoint(run, 20)
    assert (corrupt.state, corrupt.failure_reason) == ("corrupt", "crc mismatch in part-003")
    assert catalog.latest_committed(run).step == 10
    assert catalog.events(run=run)[0].action == "marked_corrupt"
    assert catalog.list_runs()[0].committed_count == 1


def test_mark_corrupt_leaves_rows_gc_is_deleting_or_deleted_and_stale_rows_alone(catalog):
    catalog.ensure_run("r", "/c", num_to_keep=1)
    for step in (1, 2, 3, 4):
        commit_step(catalog, "r", step)
    saves = {c.step: c.save_id for c in catalog.list_checkpoints("r")}
    claimed = catalog.claim_for_deletion("r", [1, 2])
    assert catalog.mark_deleted("r", 2, claimed[1].claimed_by)
    catalog.mark_missing("r", 3)
    register(catalog, "r", 1, resumed_from=0)  # step 4 becomes stale
    assert not catalog.mark_corrupt("r", 1, saves[1], "x")  # deleting: left to gc
    assert not catalog.mark_corrupt("r", 2, saves[2], "x")  # deleted by gc: files gone
    assert not catalog.mark_corrupt("r", 4, saves[4], "x")  # stale: gc removes it anyway
    assert catalog.mark_corrupt("r", 3, saves[3], "x")  # deleted by sync: files may remain
    assert _states(catalog) == {1: "deleting", 2: "deleted", 3: "corrupt", 4: "stale"}


def test_update_run_without_an_epoch_is_not_fenced(catalog, run):
    register(catalog, run, 2)
    assert catalog.update_run(run, num_to_keep=3).num_to_keep == 3  # an operator's change
    assert catalog.update_run(run, status="finished", epoch=2).status == "finished"


def test_attempt_records_are_json_ready(catalog, run):
    attempt = register(catalog, run, 1, resumed_from=3).attempt
    values = attempt.to_dict()
    assert values["started_at"] == STARTED.isoformat()
    assert values["resumed_from"] == 3 and values["epoch"] == 1
    later = STARTED + timedelta(hours=1)
    assert register(catalog, run, 2, started_at=later).attempt.started_at == later


# -- registered first, decided after -------------------------------------------------------


def register_undecided(catalog, run, epoch):
    return catalog.register_attempt(
        run,
        epoch=epoch,
        attempt_id=f"{epoch:032x}",
        host=f"h{epoch}",
        pid=4000 + epoch,
        started_at=STARTED,
    )


def test_an_undecided_attempt_fences_older_ones_but_abandons_nothing(catalog, run):
    register(catalog, run, 1)
    for step in (10, 20, 30):
        commit_step(catalog, run, step, epoch=1)
    registration = register_undecided(catalog, run, 2)
    assert registration.abandoned == () and not registration.attempt.decided
    assert set(_states(catalog).values()) == {"committed"}
    with pytest.raises(FencedOutError, match="attempt epoch 2"):
        commit_step(catalog, run, 40, epoch=1)
    # nothing is protected or abandoned until the attempt knows where it resumes
    assert catalog.retention_plan(run).decisions[0].reason.count("resume point") == 0


def test_deciding_the_resume_point_abandons_the_older_history_above_it(catalog, run):
    register(catalog, run, 1)
    for step in (10, 20, 30):
        commit_step(catalog, run, step, epoch=1)
    register_undecided(catalog, run, 2)
    decided = catalog.decide_resume(run, epoch=2, resumed_from=20)
    assert decided.abandoned == (30,) and decided.attempt.decided
    assert decided.attempt.resumed_from == 20
    assert _states(catalog) == {10: "committed", 20: "committed", 30: "stale"}
    assert catalog.events(run=run)[0].action == "resume_decided"
    # the same decision again changes nothing; another one needs a new attempt
    assert catalog.decide_resume(run, epoch=2, resumed_from=20).abandoned == ()
    with pytest.raises(InvalidValueError, match="a new resume point needs a new attempt"):
        catalog.decide_resume(run, epoch=2, resumed_from=10)


def test_only_the_current_attempt_may_decide(catalog, run):
    register_undecided(catalog, run, 1)
    register_undecided(catalog, run, 2)
    with pytest.raises(FencedOutError, match="attempt epoch 1 is no longer current"):
        catalog.decide_resume(run, epoch=1, resumed_from=None)


def test_an_undecided_attempt_is_not_part_of_the_lineage_rule(catalog, run):
    register(catalog, run, 1)
    register_undecided(catalog, run, 2)
    # a complete marker of epoch 1 at step 50 is still history while epoch 2 has not decided
    _, outcome = catalog.upsert_committed(
        run,
        50,
        "memory://ckpt/r/save-50",
        save_id="e1-abc",
        epoch=1,
        bytes=1,
        file_count=1,
        manifest_checksum="c",
    )
    assert outcome.value == "inserted"


def test_mark_stale_moves_only_that_saves_live_rows(catalog, run):
    commit_step(catalog, run, 10)
    row = catalog.get_checkpoint(run, 10)
    assert not catalog.mark_stale(run, 10, "another-save", "abandoned by storage's lineage")
    assert catalog.mark_stale(run, 10, row.save_id, "abandoned by storage's lineage")
    stale = catalog.get_checkpoint(run, 10)
    assert (stale.state, stale.failure_reason) == ("stale", "abandoned by storage's lineage")
    assert catalog.latest_committed(run) is None
    assert not catalog.mark_stale(run, 10, row.save_id, "again")  # already stale
    assert catalog.events(run=run)[0].action == "marked_stale"
