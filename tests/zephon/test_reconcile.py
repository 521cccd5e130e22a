"""The one rule (``zephon.reconcile.judge``) and how gc, sync and find_latest act on it: every
row of the documented table, abandoned checkpoints deleted only after the grace, corrupt ones
kept until ``--corrupt``, sync never promoting an abandoned marker, attempts that ran without
the catalog mirrored into it, and a failed row with a complete marker repaired."""

from __future__ import annotations

import datetime as dt
from datetime import UTC, datetime

import pytest

from tests.zephon.saves import crash_after_marker, save_step, start
from tests.zephon.test_composition import make_run
from zephon.catalog import Catalog, CheckpointRecord
from zephon.gc import GcPolicy, gc_run
from zephon.latest import find_latest
from zephon.reconcile import Verdict, judge, quarantine
from zephon.storage import AttemptRecord, CheckpointNotFoundError, Lineage, Manifest
from zephon.sync import sync_storage

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def lineage_resumed_from(step: int | None) -> Lineage:
    """A run whose attempt 2 resumed from ``step`` (attempt 1 started fresh before it)."""
    first = Lineage(None).successor(None, 1, None)
    return Lineage(Lineage(first).successor(None, 2, step))


def marker(step: int, epoch: int, save_id: str = "e1-a") -> Manifest:
    return Manifest(run="r", step=step, save_id=save_id, payload=save_id, epoch=epoch, files=())


def row(step: int, state: str, save_id: str = "e1-a", epoch: int = 1) -> CheckpointRecord:
    return CheckpointRecord(
        run="r",
        step=step,
        state=state,
        path="p",
        save_id=save_id,
        epoch=epoch,
        bytes=0,
        file_count=0,
        manifest_checksum=None,
        pinned=False,
        metadata=None,
        failure_reason=None,
        claimed_by=None,
        claimed_at=None,
        created_at=NOW,
        committed_at=None,
        updated_at=NOW,
    )


LINEAGE = lineage_resumed_from(40)  # epoch 2 resumed from step 40 of epoch 1

TABLE = [
    # (marker, damaged, condemned, row, verdict)
    (None, None, False, None, Verdict.NOTHING),
    (None, None, False, row(50, "pending"), Verdict.WAIT),
    (None, None, False, row(50, "committed"), Verdict.MISSING),
    (None, None, False, row(50, "failed"), Verdict.NOTHING),
    (None, "not json", False, row(50, "committed"), Verdict.CORRUPT),
    (marker(30, 1), None, True, row(30, "committed"), Verdict.CORRUPT),
    (marker(50, 1), None, False, row(50, "committed"), Verdict.STALE),  # above the resume point
    (marker(50, 7), None, False, None, Verdict.STALE),  # an unregistered epoch
    (marker(30, 1), None, False, row(30, "stale"), Verdict.STALE),
    (marker(30, 1), None, False, row(30, "deleting"), Verdict.WAIT),
    (marker(30, 1), None, False, row(30, "corrupt"), Verdict.CORRUPT),
    (marker(30, 1), None, False, row(30, "pending", "e2-b", 2), Verdict.WAIT),
    (marker(30, 1), None, False, None, Verdict.HISTORY),
    (marker(30, 1), None, False, row(30, "pending"), Verdict.HISTORY),
    (marker(30, 1), None, False, row(30, "committed"), Verdict.HISTORY),
    (marker(30, 1), None, False, row(30, "failed"), Verdict.REPAIR),
    (marker(30, 1), None, False, row(30, "deleted"), Verdict.REPAIR),
    (marker(30, 1), None, False, row(30, "committed", "e1-other"), Verdict.REPAIR),
    (marker(60, 2, "e2-c"), None, False, row(60, "committed", "e2-c", 2), Verdict.HISTORY),
]


@pytest.mark.parametrize(("manifest", "damaged", "condemned", "row_", "verdict"), TABLE)
def test_every_row_of_the_documented_table_has_its_verdict(
    manifest, damaged, condemned, row_, verdict
):
    got = judge(lineage=LINEAGE, marker=manifest, damaged=damaged, condemned=condemned, row=row_)
    assert got.verdict is verdict, got.reason


def test_the_lineage_helper_builds_what_a_registration_writes():
    current = LINEAGE.current
    assert isinstance(current, AttemptRecord) and current.epoch == 2
    assert LINEAGE.admits(1, 40) and not LINEAGE.admits(1, 41) and LINEAGE.admits(2, 10**6)


# -- acting on verdicts --------------------------------------------------------------------


def two_attempts(catalog, backend, **policy):
    """Epoch 1 saved 10, 20, 30; epoch 2 resumed from 10 (20 and 30 abandoned) and saved 15."""
    location = make_run(catalog, backend, **policy)
    old = start(location, catalog)
    for step in (10, 20, 30):
        save_step(old, step, catalog)
    new = start(location, catalog, resumed_from=10)
    save_step(new, 15, catalog)
    return location, old, new


def test_abandoned_checkpoints_are_stale_and_gc_deletes_them_after_the_grace(
    catalog, local_backend
):
    location, _, _ = two_attempts(catalog, local_backend)
    states = {r.step: r.state for r in catalog.list_checkpoints("r")}
    assert states == {10: "committed", 15: "committed", 20: "stale", 30: "stale"}
    gc_run(catalog, location)  # the default 24h grace keeps them
    assert location.store.run("r").committed_steps() == [10, 15, 20, 30]
    report = gc_run(catalog, location, policy=GcPolicy(grace=dt.timedelta(0)))
    assert sorted(d["step"] for d in report.deleted) == [20, 30]
    assert location.store.run("r").committed_steps() == [10, 15]
    assert location.store.run("r").list_steps()[-1].step == 15
    assert find_latest(location, catalog=catalog).step == 15


def test_a_quarantined_checkpoint_is_kept_until_gc_corrupt(catalog, local_backend):
    location = make_run(catalog, local_backend, num_to_keep=1)
    attempt = start(location, catalog)
    save_step(attempt, 1, catalog)
    bad = save_step(attempt, 2, catalog)
    quarantine(catalog, location, 2, "crc32c mismatch in w.bin", manifest=bad)
    assert catalog.get_checkpoint("r", 2).state == "corrupt"
    assert find_latest(location, catalog=catalog).step == 1
    gc_run(catalog, location, policy=GcPolicy(grace=dt.timedelta(0)))
    assert location.store.run("r").condemned() == [(2, bad.save_id)]  # kept for inspection
    assert catalog.get_checkpoint("r", 1).state == "committed"  # never counted: 1 is kept
    report = gc_run(catalog, location, policy=GcPolicy(grace=dt.timedelta(0), corrupt=True))
    assert [d["step"] for d in report.deleted] == [2]
    assert location.store.run("r").condemned() == [] and location.store.run(
        "r"
    ).committed_steps() == [1]


def test_sync_never_promotes_an_abandoned_marker(catalog, local_backend, tmp_path):
    location, _, _ = two_attempts(catalog, local_backend)
    with Catalog(f"sqlite:///{tmp_path / 'rebuilt.db'}") as rebuilt:
        report = sync_storage(rebuilt, local_backend.url)
        states = {r.step: r.state for r in rebuilt.list_checkpoints("r")}
        assert states == {10: "committed", 15: "committed", 20: "stale", 30: "stale"}
        assert report.outcomes.get("stale") == 2
        assert rebuilt.current_attempt("r").epoch == 2
        assert find_latest(location, catalog=rebuilt).step == 15


def test_an_attempt_that_ran_without_the_catalog_is_mirrored_into_it(catalog, local_backend):
    location = make_run(catalog, local_backend)
    old = start(location, catalog)
    for step in (10, 20):
        save_step(old, step, catalog)
    offline = start(location, None, resumed_from=10)  # a start that could not reach the catalog
    save_step(offline, 12)
    # the catalog alone still answers 20; reading its marker finds the attempt it missed
    trusted = find_latest(location, catalog=catalog)
    assert (trusted.step, trusted.confirmed) == (20, False)
    with pytest.raises(CheckpointNotFoundError, match="abandoned"):
        _ = trusted.manifest
    assert catalog.current_attempt("r").epoch == offline.epoch
    assert catalog.get_checkpoint("r", 20).state == "stale"
    latest = find_latest(location, catalog=catalog, confirm=True)
    assert catalog.current_attempt("r").epoch == offline.epoch
    assert catalog.get_checkpoint("r", 20).state == "stale"
    # storage's answer and the catalog's agree; the offline save is found by the probe-free
    # storage scan until sync records it
    assert latest.step == 10 and location.store.run("r").latest().step == 12
    sync_storage(catalog, local_backend.url)
    assert find_latest(location, catalog=catalog).step == 12


def test_a_failed_row_whose_marker_is_complete_is_repaired_not_looped(catalog, s3_backend):
    location = make_run(catalog, s3_backend)
    attempt = start(location, catalog)
    save_step(attempt, 10, catalog)
    manifest = crash_after_marker(attempt, catalog, 20)
    catalog.mark_failed("r", 20, manifest.save_id, "the job died after its marker")
    latest = find_latest(location, catalog=catalog)
    assert (latest.step, latest.promoted) == (20, (20,))
    assert catalog.get_checkpoint("r", 20).state == "committed"
    again = start(location, catalog, resumed_from=20)
    save_step(again, 30, catalog)  # no CommitConflictError, no loop
    assert find_latest(location, catalog=catalog).step == 30


def test_a_failed_row_whose_marker_fails_verification_is_quarantined(catalog, local_backend):
    location = make_run(catalog, local_backend)
    attempt = start(location, catalog)
    save_step(attempt, 10, catalog)
    manifest = crash_after_marker(attempt, catalog, 20)
    catalog.mark_failed("r", 20, manifest.save_id, "the job died after its marker")
    with open(f"{location.store.run('r').reader(20).path}/w.bin", "wb") as handle:
        handle.write(b"z")
    assert find_latest(location, catalog=catalog).step == 10
    assert catalog.get_checkpoint("r", 20).state == "corrupt"
    assert location.store.run("r").condemned() == [(20, manifest.save_id)]


def test_gc_records_a_marker_the_catalog_never_heard_of_and_deletes_it_when_abandoned(
    catalog, local_backend
):
    location = make_run(catalog, local_backend)
    save_step(start(location, catalog), 10, catalog)
    offline = start(location, None, resumed_from=10)  # a start that never reached the catalog
    save_step(offline, 20)
    start(location, catalog, resumed_from=10)  # the next start resumes from 10 again
    # (the start recorded 20, which the catalog missed, then abandoned it: stale at once)
    assert {r.step: r.state for r in catalog.list_checkpoints("r")} == {
        10: "committed",
        20: "stale",
    }
    gc_run(catalog, location)  # the default grace keeps it, but it now has a row
    row = catalog.get_checkpoint("r", 20)
    assert (row.state, row.epoch) == ("stale", offline.epoch)
    assert location.store.run("r").committed_steps() == [10, 20]
    report = gc_run(catalog, location, policy=GcPolicy(grace=dt.timedelta(0)))
    assert [d["step"] for d in report.deleted] == [20]
    assert location.store.run("r").committed_steps() == [10]
    assert find_latest(location, catalog=catalog).step == 10


def test_a_full_gc_pass_prunes_old_audit_events(catalog, local_backend):
    from zephon.gc import collect_garbage

    location = make_run(catalog, local_backend)
    save_step(start(location, catalog), 10, catalog)
    assert len(catalog.events(run="r")) > 3
    kept = collect_garbage(catalog)  # the default: 90 days
    assert kept.events_pruned == 0
    pruned = collect_garbage(catalog, policy=GcPolicy(events_age=dt.timedelta(microseconds=1)))
    assert pruned.events_pruned > 3
    assert [e.action for e in catalog.events()] == ["events_pruned"]
    assert collect_garbage(catalog, policy=GcPolicy(events_age=None)).events_pruned is None
