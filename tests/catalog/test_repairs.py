"""``upsert_committed``, the one "storage holds a verified marker of save S" repair: its whole
table by row state, and the lineage defence that never promotes an abandoned or unregistered
attempt's marker."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from tests.catalog.conftest import commit_step, register
from zephon.catalog import SyncOutcome


def _marker(save_id: str, epoch: int, **facts):
    return {
        "save_id": save_id,
        "epoch": epoch,
        "bytes": facts.get("bytes", 10),
        "file_count": 2,
        "manifest_checksum": facts.get("manifest_checksum", "m"),
    }


def _upsert(catalog, step, save_id, epoch=1, run="r", **facts):
    return catalog.upsert_committed(run, step, f"/c/{step}", **_marker(save_id, epoch, **facts))


@pytest.fixture
def fenced(catalog):
    """Run ``r`` whose current attempt is epoch 1 (a fresh start)."""
    catalog.ensure_run("r", "/c")
    register(catalog, "r", 1)
    return "r"


def _arrange(catalog, run, state: str) -> str:
    """Put step 5 in ``state`` under epoch 1; returns the row's save id."""
    if state == "deleting":
        catalog.update_run(run, num_to_keep=1)
        commit_step(catalog, run, 5, epoch=1)
        commit_step(catalog, run, 6, epoch=1)
        [claimed] = catalog.claim_for_deletion(run, [5])
        return claimed.save_id
    begun = catalog.begin_checkpoint(run, 5, "/c/5", epoch=1)
    if state == "failed":
        catalog.mark_failed(run, 5, begun.save_id, "x")
    elif state in ("committed", "deleted", "corrupt"):
        catalog.mark_committed(
            run, 5, begun.save_id, epoch=1, bytes=10, file_count=2, manifest_checksum="m"
        )
        if state == "deleted":
            catalog.mark_missing(run, 5)
        elif state == "corrupt":
            catalog.mark_corrupt(run, 5, begun.save_id, "crc mismatch")
    return begun.save_id


@pytest.mark.parametrize(
    ("state", "same_save", "outcome", "after"),
    [
        pytest.param("pending", True, SyncOutcome.PROMOTED, "committed", id="pending-same-save"),
        pytest.param("pending", False, SyncOutcome.SKIPPED, "pending", id="pending-newer-save"),
        pytest.param("committed", True, SyncOutcome.UNCHANGED, "committed", id="committed-same"),
        pytest.param("committed", False, SyncOutcome.UPDATED, "committed", id="committed-other"),
        pytest.param("failed", True, SyncOutcome.PROMOTED, "committed", id="failed-same"),
        pytest.param("failed", False, SyncOutcome.PROMOTED, "committed", id="failed-other"),
        pytest.param("deleted", True, SyncOutcome.PROMOTED, "committed", id="deleted-same"),
        pytest.param("deleted", False, SyncOutcome.PROMOTED, "committed", id="deleted-other"),
        pytest.param("corrupt", True, SyncOutcome.SKIPPED, "corrupt", id="corrupt"),
        pytest.param("deleting", True, SyncOutcome.SKIPPED, "deleting", id="deleting"),
    ],
)
def test_upsert_committed_follows_its_table_for_every_row_state(
    catalog, fenced, state, same_save, outcome, after
):
    save_id = _arrange(catalog, fenced, state)
    marker_save = save_id if same_save else "marker-save"
    record, got = _upsert(catalog, 5, marker_save)
    assert (got, record.state) == (outcome, after)
    if outcome in (SyncOutcome.PROMOTED, SyncOutcome.UPDATED):
        # Storage is the truth: the row now names the marker's save and attempt.
        assert (record.save_id, record.epoch) == (marker_save, 1)
        assert catalog.events(run=fenced)[0].action == f"sync_{outcome}"
    else:
        assert record.save_id == save_id


def test_upsert_committed_inserts_a_missing_row_with_the_markers_save_and_epoch(catalog, fenced):
    record, outcome = _upsert(catalog, 9, "found-on-storage")
    assert outcome is SyncOutcome.INSERTED
    assert (record.state, record.save_id, record.epoch) == ("committed", "found-on-storage", 1)


def test_committed_facts_that_differ_from_the_marker_are_updated(catalog, fenced):
    save_id = _arrange(catalog, fenced, "committed")
    record, outcome = _upsert(catalog, 5, save_id, manifest_checksum="m2")
    assert outcome is SyncOutcome.UPDATED and record.manifest_checksum == "m2"


def test_a_stale_row_is_never_promoted(catalog, fenced):
    save_id = _arrange(catalog, fenced, "committed")
    register(catalog, fenced, 2, resumed_from=None)
    assert catalog.get_checkpoint(fenced, 5).state == "stale"
    record, outcome = _upsert(catalog, 5, save_id, epoch=1)
    assert outcome is SyncOutcome.STALE and record.state == "stale"


def test_a_stale_row_is_skipped_even_for_a_marker_of_the_current_lineage(catalog, fenced):
    _arrange(catalog, fenced, "committed")
    register(catalog, fenced, 2, resumed_from=None)
    record, outcome = _upsert(catalog, 5, "written-by-epoch-2", epoch=2)
    assert (outcome, record.state) == (SyncOutcome.SKIPPED, "stale")


def test_a_marker_of_an_abandoned_lineage_is_recorded_stale_never_committed(catalog, fenced):
    register(catalog, fenced, 2, resumed_from=10)
    record, outcome = _upsert(catalog, 20, "old-lineage", epoch=1)
    assert outcome is SyncOutcome.STALE
    assert (record.state, record.save_id, record.epoch) == ("stale", "old-lineage", 1)
    assert record.failure_reason == "abandoned: attempt epoch 2 resumed from step 10"
    assert [(c.step, c.state) for c in catalog.list_checkpoints(fenced)] == [(20, "stale")]
    assert catalog.latest_committed(fenced) is None
    # At or below the point the newer attempt resumed from, the history is shared.
    assert _upsert(catalog, 10, "shared", epoch=1)[1] is SyncOutcome.INSERTED


def test_a_live_row_of_an_abandoned_lineage_is_made_stale(catalog, fenced):
    # A catalog written by code that did not stale on registration: the row says committed.
    save_id = _arrange(catalog, fenced, "committed")
    register(catalog, fenced, 2, resumed_from=2)
    with catalog._db.engine.begin() as connection:
        connection.execute(text("UPDATE checkpoints SET state = 'committed' WHERE step = 5"))
    assert catalog.latest_committed(fenced).step == 5

    record, outcome = _upsert(catalog, 5, save_id, epoch=1)
    assert (outcome, record.state) == (SyncOutcome.STALE, "stale")
    assert record.failure_reason == "abandoned: attempt epoch 2 resumed from step 2"
    assert catalog.events(run=fenced)[0].action == "sync_staled"
    assert catalog.latest_committed(fenced) is None


def test_a_marker_of_an_unregistered_attempt_is_not_promoted(catalog, fenced):
    begun = catalog.begin_checkpoint(fenced, 5, "/c/5", epoch=1)
    record, outcome = _upsert(catalog, 5, begun.save_id, epoch=3)
    assert (outcome, record.state) == (SyncOutcome.STALE, "pending")
    record, outcome = _upsert(catalog, 6, "from-the-future", epoch=3)
    assert (outcome, record.state) == (SyncOutcome.STALE, "stale")  # recorded for gc


def test_the_resume_probe_repairs_a_crash_between_marker_and_catalog(catalog, fenced):
    # The job wrote the marker of step 5 and died before mark_committed.
    save_id = _arrange(catalog, fenced, "pending")
    register(catalog, fenced, 2, resumed_from=5)  # its successor resumes from step 5
    assert catalog.get_checkpoint(fenced, 5).state == "pending"  # the resume step stays
    probe = catalog.rows_after(fenced, None, states=["pending", "failed", "deleted"])
    assert [(c.step, c.save_id) for c in probe] == [(5, save_id)]
    record, outcome = _upsert(catalog, 5, save_id, epoch=1)
    assert (outcome, record.state) == (SyncOutcome.PROMOTED, "committed")
    assert catalog.latest_committed(fenced).step == 5


def test_upsert_committed_is_idempotent(catalog, fenced):
    assert _upsert(catalog, 3, "s")[1] is SyncOutcome.INSERTED
    for _ in range(2):
        assert _upsert(catalog, 3, "s")[1] is SyncOutcome.UNCHANGED
    assert [e.action for e in catalog.events(run=fenced)].count("sync_inserted") == 1
