"""The checkpoint state machine on the save path, sync repairs, pins and the read queries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.catalog.conftest import commit_step
from zephon.catalog import (
    CheckpointExistsError,
    CheckpointRecordNotFoundError,
    InvalidTransitionError,
    InvalidValueError,
    RunNotFoundError,
    StateConflictError,
    SyncOutcome,
    guarded,
)


def _actions(catalog, run="r"):
    return [e.action for e in reversed(catalog.events(run=run))]


def test_begin_then_commit_records_the_facts(catalog, run):
    begun = catalog.begin_checkpoint(run, 100, "memory://ckpt/r/save-100")
    assert (begun.state, begun.path, begun.pinned) == ("pending", "memory://ckpt/r/save-100", False)
    assert len(begun.save_id) == 32 and begun.committed_at is None

    committed = catalog.mark_committed(
        run,
        100,
        begun.save_id,
        bytes=4096,
        file_count=7,
        manifest_checksum="crc:abcd",
        metadata={"loss": 0.25, "tokens": [1, 2]},
    )
    assert committed.state == "committed"
    assert (committed.bytes, committed.file_count, committed.manifest_checksum) == (
        4096,
        7,
        "crc:abcd",
    )
    assert committed.metadata == {"loss": 0.25, "tokens": [1, 2]}
    assert committed.committed_at.tzinfo == UTC
    assert committed.save_id == begun.save_id
    assert catalog.get_checkpoint(run, 100) == committed
    assert _actions(catalog) == ["run_created", "begun", "committed"]


def test_mark_committed_again_by_the_same_attempt_is_a_no_op(catalog, run):
    begun = catalog.begin_checkpoint(run, 1, "/c/1")
    first = catalog.mark_committed(
        run, 1, begun.save_id, bytes=1, file_count=1, manifest_checksum="x"
    )
    again = catalog.mark_committed(
        run, 1, begun.save_id, bytes=1, file_count=1, manifest_checksum="x"
    )
    assert again == first
    assert _actions(catalog).count("committed") == 1


def test_mark_committed_with_a_foreign_attempt_raises_state_conflict(catalog, run):
    begun = catalog.begin_checkpoint(run, 1, "/c/1")
    with pytest.raises(StateConflictError) as caught:
        catalog.mark_committed(
            run, 1, "someone-else", bytes=1, file_count=1, manifest_checksum=None
        )
    error = caught.value
    assert (error.run, error.step, error.state, error.action) == (run, 1, "pending", "commit")
    assert (error.expected_save, error.found_save) == ("someone-else", begun.save_id)
    assert "zephon checkpoints r" in str(error)
    assert catalog.get_checkpoint(run, 1).state == "pending"


def test_a_committed_step_is_never_re_armed(catalog, run):
    commit_step(catalog, run, 5)
    with pytest.raises(CheckpointExistsError) as caught:
        catalog.begin_checkpoint(run, 5, "/c/5-again")
    assert caught.value.path == "memory://ckpt/r/save-5"
    assert "never overwritten" in str(caught.value) and "step 5" in str(caught.value)
    assert catalog.get_checkpoint(run, 5).state == "committed"


@pytest.mark.parametrize("previous", ["failed", "deleted", "pending"])
def test_failed_deleted_and_crashed_pending_steps_are_re_armed(catalog, run, previous):
    old = catalog.begin_checkpoint(run, 7, "/c/old-7")
    if previous == "failed":
        catalog.mark_failed(run, 7, old.save_id, "rank 3 died")
    elif previous == "deleted":
        catalog.mark_committed(
            run, 7, old.save_id, bytes=9, file_count=2, manifest_checksum="m", metadata={"a": 1}
        )
        assert catalog.mark_missing(run, 7)

    new = catalog.begin_checkpoint(run, 7, "/c/new-7")
    assert new.state == "pending" and new.save_id != old.save_id
    assert (new.path, new.bytes, new.metadata, new.failure_reason, new.committed_at) == (
        "/c/new-7",
        None,
        None,
        None,
        None,
    )
    rearmed = catalog.events(run=run)[0]
    assert rearmed.action == "rearmed"
    assert rearmed.detail["previous"]["state"] == previous
    assert rearmed.detail["previous"]["save_id"] == old.save_id

    # The older attempt has lost the step for good.
    with pytest.raises(StateConflictError):
        catalog.mark_committed(run, 7, old.save_id, bytes=1, file_count=1, manifest_checksum=None)
    with pytest.raises(StateConflictError):
        catalog.mark_failed(run, 7, old.save_id, "late failure report")
    catalog.mark_committed(run, 7, new.save_id, bytes=1, file_count=1, manifest_checksum=None)


def test_a_step_being_deleted_cannot_be_begun_or_pinned(catalog):
    catalog.ensure_run("r", "/c", num_to_keep=1)
    commit_step(catalog, "r", 1)
    commit_step(catalog, "r", 2)
    [claimed] = catalog.claim_for_deletion("r", [1])
    with pytest.raises(InvalidTransitionError) as caught:
        catalog.begin_checkpoint("r", 1, "/c/1")
    assert not isinstance(caught.value, CheckpointExistsError)
    assert caught.value.state == "deleting" and claimed.claimed_by in str(caught.value)
    with pytest.raises(InvalidTransitionError, match="only pending or committed"):
        catalog.pin("r", 1)


def test_a_begin_that_keeps_losing_the_re_arm_race_gives_up_as_contended(catalog, run, monkeypatch):
    first = catalog.begin_checkpoint(run, 3, "/c/3")
    catalog.mark_failed(run, 3, first.save_id, "crashed")
    lost = []
    # Every guarded re-arm misses, as when another save re-arms the row first each round.
    monkeypatch.setattr(guarded, "update_one", lambda *args: lost.append(args[1]))
    with pytest.raises(InvalidTransitionError) as caught:
        catalog.begin_checkpoint(run, 3, "/c/3")
    assert caught.value.state == "contended" and caught.value.action == "begin"
    assert "5 concurrent begins raced for it" in str(caught.value)
    assert "\n" not in str(caught.value) and len(lost) == 5
    monkeypatch.undo()
    assert catalog.get_checkpoint(run, 3).state == "failed"  # the refused begin changed nothing


def test_failed_then_commit_by_the_same_attempt_is_a_conflict(catalog, run):
    begun = catalog.begin_checkpoint(run, 3, "/c/3")
    failed = catalog.mark_failed(run, 3, begun.save_id, "stale: no marker after grace")
    assert failed.failure_reason == "stale: no marker after grace"
    assert catalog.mark_failed(run, 3, begun.save_id, "again") == failed  # idempotent
    with pytest.raises(StateConflictError) as caught:
        catalog.mark_committed(run, 3, begun.save_id, bytes=1, file_count=1, manifest_checksum=None)
    assert caught.value.state == "failed"
    assert "moved it first" in str(caught.value)


def test_transitions_on_missing_rows_and_runs_name_them(catalog, run):
    with pytest.raises(CheckpointRecordNotFoundError) as caught:
        catalog.mark_committed(run, 9, "a", bytes=1, file_count=1, manifest_checksum=None)
    assert (caught.value.run, caught.value.step) == (run, 9)
    assert "zephon checkpoints r" in str(caught.value)
    with pytest.raises(CheckpointRecordNotFoundError):
        catalog.get_checkpoint(run, 9)
    with pytest.raises(RunNotFoundError):
        catalog.begin_checkpoint("ghost", 1, "/c")


@pytest.mark.parametrize("step", [-1, True, 1.5, "3"])
def test_invalid_steps_are_refused(catalog, run, step):
    with pytest.raises(InvalidValueError, match="step"):
        catalog.begin_checkpoint(run, step, "/c")


def test_checkpoint_paths_with_credentials_are_refused(catalog, run):
    with pytest.raises(InvalidValueError, match="path"):
        catalog.begin_checkpoint(run, 1, "s3://AKIA:secret@bucket/save-1")


def test_latest_committed_is_the_highest_committed_step(catalog, run):
    assert catalog.latest_committed(run) is None
    commit_step(catalog, run, 10)
    commit_step(catalog, run, 5)  # committed later, but older
    catalog.begin_checkpoint(run, 20, "/c/20")
    assert catalog.latest_committed(run).step == 10
    with pytest.raises(RunNotFoundError):
        catalog.latest_committed("ghost")


def test_pending_after_lists_newer_pending_rows_newest_first(catalog, run):
    commit_step(catalog, run, 10)
    for step in (5, 11, 12):
        catalog.begin_checkpoint(run, step, f"/c/{step}")
    assert [c.step for c in catalog.pending_after(run, 10)] == [12, 11]
    assert [c.step for c in catalog.pending_after(run, None)] == [12, 11, 5]


def test_rows_after_lists_the_rows_the_resume_probe_checks_newest_first(catalog, run):
    commit_step(catalog, run, 10)
    commit_step(catalog, run, 13)
    failed = catalog.begin_checkpoint(run, 11, "/c/11")
    catalog.mark_failed(run, 11, failed.save_id, "x")
    catalog.begin_checkpoint(run, 12, "/c/12")
    catalog.begin_checkpoint(run, 9, "/c/9")
    catalog.mark_missing(run, 13)
    probe = ["pending", "failed", "deleted"]
    assert [(c.step, c.state) for c in catalog.rows_after(run, 10, states=probe)] == [
        (13, "deleted"),
        (12, "pending"),
        (11, "failed"),
    ]
    assert [c.step for c in catalog.rows_after(run, None, states="pending")] == [12, 9]
    with pytest.raises(InvalidValueError, match="state"):
        catalog.rows_after(run, None, states=[])


def test_list_checkpoints_in_step_order_and_by_state(catalog, run):
    for step in (3, 1, 2):
        commit_step(catalog, run, step)
    catalog.begin_checkpoint(run, 4, "/c/4")
    assert [c.step for c in catalog.list_checkpoints(run)] == [1, 2, 3, 4]
    assert [c.step for c in catalog.list_checkpoints(run, states="pending")] == [4]
    assert [c.step for c in catalog.list_checkpoints(run, states=["committed"])] == [1, 2, 3]
    with pytest.raises(InvalidValueError, match="state"):
        catalog.list_checkpoints(run, states=["done"])


def test_pin_and_unpin_are_idempotent_and_audited(catalog, run):
    commit_step(catalog, run, 1)
    assert catalog.pin(run, 1).pinned
    assert catalog.pin(run, 1).pinned
    assert not catalog.unpin(run, 1).pinned
    assert not catalog.unpin(run, 1).pinned
    assert _actions(catalog)[-2:] == ["pinned", "unpinned"]
    begun = catalog.begin_checkpoint(run, 2, "/c/2")
    assert catalog.pin(run, 2).pinned  # a step being written may be pinned in advance
    catalog.mark_failed(run, 2, begun.save_id, "x")
    catalog.unpin(run, 2)
    with pytest.raises(InvalidTransitionError, match="is failed"):
        catalog.pin(run, 2)
    with pytest.raises(CheckpointRecordNotFoundError):
        catalog.pin(run, 99)


def _marker(save_id="s1", epoch=0, **facts):
    """The keyword arguments of upsert_committed for a verified marker of ``save_id``."""
    return {
        "save_id": save_id,
        "epoch": epoch,
        "bytes": 10,
        "file_count": 2,
        "manifest_checksum": "m1",
        **facts,
    }


def test_upsert_committed_inserts_then_reports_unchanged_then_updates(catalog, run):
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    record, outcome = catalog.upsert_committed(run, 4, "/c/save-4", committed_at=at, **_marker())
    assert outcome is SyncOutcome.INSERTED
    assert (record.state, record.committed_at, record.bytes) == ("committed", at, 10)
    assert (record.save_id, record.epoch) == ("s1", 0)
    assert catalog.upsert_committed(run, 4, "/c/save-4", **_marker())[1] is SyncOutcome.UNCHANGED
    record, outcome = catalog.upsert_committed(
        run, 4, "/c/save-4", **_marker(manifest_checksum="m2")
    )
    assert outcome is SyncOutcome.UPDATED and record.manifest_checksum == "m2"
    assert _actions(catalog)[-2:] == ["sync_inserted", "sync_updated"]


def test_upsert_committed_promotes_a_pending_row_of_the_same_save(catalog, run):
    # A crash between the marker and mark_committed: sync (or the probe) finds the marker.
    begun = catalog.begin_checkpoint(run, 8, "/c/save-8")
    record, outcome = catalog.upsert_committed(run, 8, "/c/save-8", **_marker(begun.save_id))
    assert outcome is SyncOutcome.PROMOTED and record.save_id == begun.save_id
    # The writer, still alive, finishes its own commit without an error.
    catalog.mark_committed(run, 8, begun.save_id, bytes=5, file_count=1, manifest_checksum="m")
    assert catalog.latest_committed(run).step == 8


def test_upsert_committed_promotes_failed_and_deleted_rows_with_the_markers_save(catalog, run):
    failed = catalog.begin_checkpoint(run, 1, "/c/1")
    catalog.mark_failed(run, 1, failed.save_id, "x")
    commit_step(catalog, run, 2)
    catalog.mark_missing(run, 2)
    for step in (1, 2):
        record, outcome = catalog.upsert_committed(run, step, f"/c/{step}", **_marker("found"))
        assert outcome is SyncOutcome.PROMOTED
        assert (record.state, record.failure_reason, record.save_id) == ("committed", None, "found")


def test_upsert_committed_leaves_rows_being_deleted_to_gc(catalog):
    catalog.ensure_run("r", "/c", num_to_keep=1)
    commit_step(catalog, "r", 1)
    commit_step(catalog, "r", 2)
    [claimed] = catalog.claim_for_deletion("r", [1])
    record, outcome = catalog.upsert_committed("r", 1, "/c/1", **_marker(claimed.save_id))
    assert outcome is SyncOutcome.SKIPPED and record.state == "deleting"


def test_mark_missing_deletes_committed_rows_only(catalog, run):
    commit_step(catalog, run, 1)
    commit_step(catalog, run, 2)
    catalog.begin_checkpoint(run, 3, "/c/3")
    assert catalog.mark_missing(run, 2)
    assert not catalog.mark_missing(run, 2)
    assert not catalog.mark_missing(run, 3)  # pending: possibly still being written
    gone = catalog.get_checkpoint(run, 2)
    assert (gone.state, gone.failure_reason) == ("deleted", "commit marker missing on storage")
    assert catalog.latest_committed(run).step == 1
    assert _actions(catalog).count("marked_missing") == 1


def test_records_are_detached_snapshots_with_utc_timestamps(catalog, run):
    before = datetime.now(UTC) - timedelta(seconds=1)
    commit_step(catalog, run, 1)
    record = catalog.get_checkpoint(run, 1)
    for stamp in (record.created_at, record.updated_at, record.committed_at):
        assert stamp.tzinfo == UTC and stamp >= before
    as_dict = record.to_dict()
    assert as_dict["state"] == "committed" and isinstance(as_dict["created_at"], str)
