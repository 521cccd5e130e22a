"""The catalog and storage composed: the save path, latest with the marker probe, sync, gc."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from tests.conftest import DISK_AND_OBJECT_STORE
from tests.zephon.saves import crash_after_marker, crash_before_marker, save_step, start
from zephon.catalog import Catalog
from zephon.gc import GcPolicy, collect_garbage, gc_run, retain_without_catalog
from zephon.latest import find_latest
from zephon.locations import RunLocation, run_location
from zephon.saving import Save
from zephon.storage.backend import list_files
from zephon.sync import sync_storage


@pytest.fixture(params=DISK_AND_OBJECT_STORE)
def store_backend(request, tmp_path):
    from tests.conftest import make_backend

    return make_backend(request.param, request, tmp_path)


def make_run(catalog: Catalog, backend, name="r", **policy) -> RunLocation:
    store = backend.open_store()
    record = catalog.ensure_run(name, store.location.canonical_url, **policy)
    return run_location(record, backend.storage_options)


# -- the save path and latest --------------------------------------------------------------


def test_saving_commits_the_row_with_the_manifest_facts(catalog, store_backend):
    location = make_run(catalog, store_backend)
    save_step(start(location, catalog), 10, catalog)
    row = catalog.get_checkpoint("r", 10)
    manifest = location.store.run("r").read_manifest(10)
    assert row.state == "committed"
    assert (row.save_id, row.epoch) == (manifest.save_id, manifest.epoch) and row.epoch == 1
    assert (row.bytes, row.file_count) == (manifest.total_bytes, 2)
    assert row.manifest_checksum == manifest.checksum()
    assert row.path == location.checkpoint_url(10)


def test_a_failed_save_leaves_a_failed_row_and_no_files(catalog, local_backend):
    location = make_run(catalog, local_backend)
    failing = pytest.raises(RuntimeError, match="disk on fire")
    with failing, Save.begin(start(location, catalog), 5, catalog=catalog) as writer:
        writer.write_bytes("a", b"1")
        raise RuntimeError("disk on fire")
    assert catalog.get_checkpoint("r", 5).state == "failed"
    assert "disk on fire" in catalog.get_checkpoint("r", 5).failure_reason
    assert location.store.run("r").list_steps() == []


def test_forgetting_to_commit_is_an_error_not_a_silent_pending(catalog, local_backend):
    location = make_run(catalog, local_backend)
    forgot = pytest.raises(RuntimeError, match="was not committed inside the block")
    with forgot, Save.begin(start(location, catalog), 5, catalog=catalog) as writer:
        writer.write_bytes("a", b"1")
    assert catalog.get_checkpoint("r", 5).state == "failed"


def test_latest_is_the_newest_committed_row(catalog, store_backend):
    location = make_run(catalog, store_backend)
    attempt = start(location, catalog)
    for step in (1, 5, 3):
        save_step(attempt, step, catalog)
    latest = find_latest(location, catalog=catalog)
    assert (latest.step, latest.source, latest.url) == (5, "catalog", location.checkpoint_url(5))


def test_a_crash_between_marker_and_catalog_is_repaired_by_the_probe(catalog, store_backend):
    location = make_run(catalog, store_backend)
    attempt = start(location, catalog)
    save_step(attempt, 1, catalog)
    crash_after_marker(attempt, catalog, 2)
    crash_before_marker(attempt, catalog, 3)
    assert catalog.latest_committed("r").step == 1
    latest = find_latest(location, catalog=catalog)
    assert (latest.step, latest.promoted) == (2, (2,))
    assert catalog.get_checkpoint("r", 2).state == "committed"
    assert catalog.get_checkpoint("r", 3).state == "pending"  # its writer may still be alive


def test_a_committed_row_whose_marker_vanished_is_marked_and_skipped(catalog, local_backend):
    location = make_run(catalog, local_backend)
    attempt = start(location, catalog)
    save_step(attempt, 1, catalog)
    save_step(attempt, 2, catalog)
    location.store.run("r").delete(2)  # behind the catalog's back
    assert find_latest(location, catalog=catalog).step == 2  # the catalog alone: unchecked
    latest = find_latest(location, catalog=catalog, confirm=True)
    assert (latest.step, latest.missing) == (1, (2,))
    assert catalog.get_checkpoint("r", 2).state == "deleted"


def test_without_a_catalog_the_storage_scan_answers(local_backend):
    store = local_backend.open_store()
    location = RunLocation("r", store, "r")
    attempt = start(location)
    for step in (2, 7):
        save_step(attempt, step)
    latest = find_latest(location)
    assert (latest.step, latest.source) == (7, "storage")
    assert find_latest(RunLocation("other", store, "other")) is None


def test_a_run_unknown_to_the_catalog_falls_back_to_storage(sqlite_catalog, local_backend):
    store = local_backend.open_store()
    save_step(start(RunLocation("r", store, "r")), 4)
    latest = find_latest(RunLocation("r", store, "r"), catalog=sqlite_catalog)
    assert (latest.step, latest.source) == (4, "storage")


# -- sync ------------------------------------------------------------------------------------


def test_sync_rebuilds_the_catalog_from_storage_and_is_idempotent(catalog, store_backend):
    store = store_backend.open_store()
    for run, steps in (("alpha", (1, 2)), ("beta", (10,))):
        attempt = start(RunLocation(run, store, run))
        for step in steps:
            save_step(attempt, step)
    save_step(start(RunLocation("x", store, None)), 3)  # inference layout at the root
    crash_before_marker(attempt, None, 99)

    report = sync_storage(catalog, store_backend.url, store_backend.storage_options)
    assert sorted(report.runs) == ["alpha", "beta", "ckpt"]
    assert report.outcomes == {"inserted": 4} and not report.problems
    assert [r.step for r in catalog.list_checkpoints("alpha")] == [1, 2]
    inference = catalog.get_run("ckpt")
    assert inference.kind == "inference" and inference.storage_url == store.location.canonical_url
    row = catalog.get_checkpoint("alpha", 2)
    assert row.manifest_checksum == store.run("alpha").read_manifest(2).checksum()

    again = sync_storage(catalog, store_backend.url, store_backend.storage_options)
    assert again.outcomes == {"unchanged": 4}

    store.run("alpha").delete(1)
    third = sync_storage(catalog, store_backend.url, store_backend.storage_options)
    assert third.marked_missing == [("alpha", 1)]
    assert catalog.get_checkpoint("alpha", 1).state == "deleted"


def test_sync_reports_a_run_registered_elsewhere_and_continues(catalog, local_backend, tmp_path):
    store = local_backend.open_store()
    save_step(start(RunLocation("a", store, "a")), 1)
    save_step(start(RunLocation("b", store, "b")), 1)
    catalog.ensure_run("a", str(tmp_path / "elsewhere"))
    report = sync_storage(catalog, local_backend.url)
    assert report.runs == ["b"]
    assert len(report.problems) == 1 and "run a" in report.problems[0]


# -- gc ----------------------------------------------------------------------------------------


def test_gc_keeps_the_newest_n_milestones_and_pins(catalog, store_backend):
    location = make_run(catalog, store_backend, num_to_keep=2, keep_every_steps=4)
    attempt = start(location, catalog)
    for step in range(1, 10):
        save_step(attempt, step, catalog)
    catalog.pin("r", 3)
    report = collect_garbage(catalog, storage_options=store_backend.storage_options)
    assert sorted(d["step"] for d in report.deleted) == [1, 2, 5, 6, 7]
    assert all(d["files"] == 2 for d in report.deleted)
    kept = [r.step for r in catalog.list_checkpoints("r", states="committed")]
    assert kept == [3, 4, 8, 9]
    assert location.store.run("r").committed_steps() == kept
    for step in (1, 2, 5, 6, 7):
        assert catalog.get_checkpoint("r", step).state == "deleted"
        assert (
            list_files(location.store.location, location.store.run("r").checkpoint_path(step)) == []
        )


def test_gc_dry_run_changes_nothing(catalog, local_backend):
    location = make_run(catalog, local_backend, num_to_keep=1)
    attempt = start(location, catalog)
    for step in range(3):
        save_step(attempt, step, catalog)
    report = collect_garbage(catalog, dry_run=True)
    assert [d["step"] for d in report.deleted] == [0, 1]
    assert location.store.run("r").committed_steps() == [0, 1, 2]
    assert [r.state for r in catalog.list_checkpoints("r")] == ["committed"] * 3


def test_gc_never_deletes_the_newest_or_a_young_pending(catalog, local_backend):
    location = make_run(catalog, local_backend, num_to_keep=1)
    attempt = start(location, catalog)
    save_step(attempt, 1, catalog)
    crash_before_marker(attempt, catalog, 2)
    collect_garbage(catalog, policy=GcPolicy(grace=dt.timedelta(0)))
    assert catalog.get_checkpoint("r", 1).state == "committed"
    assert catalog.get_checkpoint("r", 2).state == "pending"
    assert [s.step for s in location.store.run("r").list_steps()] == [1, 2]


def test_gc_settles_stale_pending_rows_and_removes_their_orphans(catalog, local_backend):
    location = make_run(catalog, local_backend)
    attempt = start(location, catalog)
    save_step(attempt, 1, catalog)
    crash_after_marker(attempt, catalog, 2)  # complete, catalog never told
    crash_before_marker(attempt, catalog, 3)  # torn
    # an orphan the catalog never heard of: a save whose row was lost
    leftover = location.store.run("r").begin(4, fence=attempt.fence)
    leftover.write_bytes("x", b"1")
    time.sleep(0.05)
    short = dt.timedelta(seconds=0.01)
    report = collect_garbage(catalog, policy=GcPolicy(grace=short, pending_grace=short))
    assert {(s["step"], s["to"]) for s in report.settled} == {(2, "committed"), (3, "failed")}
    assert sorted(o["step"] for o in report.orphans) == [3, 4]
    assert catalog.get_checkpoint("r", 2).state == "committed"
    assert location.store.run("r").committed_steps() == [1, 2]
    assert [s.step for s in location.store.run("r").list_steps()] == [1, 2]
    assert any(e.action == "orphan_removed" for e in catalog.events(run="r"))


def test_gc_finishes_a_delete_a_crashed_gc_left(catalog, store_backend):
    location = make_run(catalog, store_backend, num_to_keep=1)
    attempt = start(location, catalog)
    for step in range(3):
        save_step(attempt, step, catalog)
    # a gc that claimed steps 0 and 1, removed step 0's marker, and died
    claimed = catalog.claim_for_deletion("r", [0, 1])
    assert [r.step for r in claimed] == [0, 1]
    location.store.location.fs.rm_file(f"{location.store.run('r').checkpoint_path(0)}/_COMMIT")
    # within the lease nobody else touches the claim
    report = gc_run(catalog, location)
    assert report.deleted == []
    assert {r.state for r in catalog.list_checkpoints("r") if r.step < 2} == {"deleting"}
    report = gc_run(catalog, location, policy=GcPolicy(lease=dt.timedelta(microseconds=1)))
    assert sorted(d["step"] for d in report.deleted) == [0, 1]
    assert [s.step for s in location.store.run("r").list_steps()] == [2]
    assert [r.state for r in catalog.list_checkpoints("r")] == ["deleted", "deleted", "committed"]


def test_retention_without_a_catalog_keeps_the_newest_n(local_backend):
    store = local_backend.open_store()
    location = RunLocation("r", store, "r")
    attempt = start(location)
    for step in range(6):
        save_step(attempt, step)
    fence = attempt.fence
    assert retain_without_catalog(store, "r", fence, num_to_keep=2, keep_every_steps=3) == [1, 2]
    assert store.run("r").committed_steps() == [0, 3, 4, 5]
    assert retain_without_catalog(store, "r", fence, num_to_keep=1) == [0, 3, 4]
    assert store.run("r").committed_steps() == [5]
    assert retain_without_catalog(store, "r", fence, num_to_keep=None) == []
