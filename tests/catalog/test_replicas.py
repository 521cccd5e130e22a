"""Save timings and checkpoint replicas per tier, on SQLite and PostgreSQL: every legal and
illegal replica transition, timings validation and merging, the ``replicas()`` filters, the
events they record, and a two-process race between an old save's upload committing and a new
save re-arming the row."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import create_engine, text

from tests.catalog import workers
from tests.catalog.conftest import commit_step, in_threads
from zephon.catalog import (
    TIMING_PHASES,
    CheckpointRecordNotFoundError,
    InvalidTransitionError,
    InvalidValueError,
    ReplicaNotFoundError,
    ReplicaRecord,
    RunNotFoundError,
    StateConflictError,
    replicas,
)

LOCAL = {"tier": "local", "host": "node-1"}
SHARED = {"tier": "save_dir", "host": ""}


def started(catalog, step=5, save_id="s1", where=LOCAL, location=None):
    location = location or f"/local/r/save-{step}"
    return catalog.replica_started("r", step, location=location, save_id=save_id, **where)


def committed(catalog, step=5, save_id="s1", where=LOCAL, size=100, timings=None):
    return catalog.replica_committed(
        "r", step, save_id=save_id, bytes=size, timings=timings, **where
    )


def failed(catalog, step=5, save_id="s1", where=LOCAL, reason="disk full"):
    return catalog.replica_failed("r", step, save_id=save_id, reason=reason, **where)


def replica_events(catalog):
    return [
        (e.action, e.step, e.detail.get("save_id"))
        for e in reversed(catalog.events(run="r"))
        if e.action.startswith("replica_")
    ]


# -- timings -----------------------------------------------------------------------------------


def test_commit_records_timings_and_add_timings_merges_later_ones(catalog, run):
    row = catalog.begin_checkpoint(run, 1, "/c/r/save-1")
    assert row.timings is None
    done = catalog.mark_committed(
        run,
        1,
        row.save_id,
        bytes=1,
        file_count=1,
        manifest_checksum=None,
        timings={"write_s": 2, "commit_s": 0.25},
    )
    assert done.timings == {"write_s": 2.0, "commit_s": 0.25}
    assert isinstance(done.timings["write_s"], float)
    updated = catalog.get_checkpoint(run, 1).updated_at
    catalog.add_timings(run, 1, row.save_id, {"stall_s": 0.5, "write_s": 3.0})
    again = catalog.get_checkpoint(run, 1)
    assert again.timings == {"write_s": 3.0, "commit_s": 0.25, "stall_s": 0.5}
    assert again.updated_at == updated  # retention's clock is left alone
    assert again.to_dict()["timings"] == again.timings
    # A repeated commit of the same save is still idempotent, and merges what it brings.
    catalog.mark_committed(
        run,
        1,
        row.save_id,
        bytes=1,
        file_count=1,
        manifest_checksum=None,
        timings={"total_s": 4.0},
    )
    assert catalog.get_checkpoint(run, 1).timings["total_s"] == 4.0
    events = [e for e in catalog.events(run=run) if e.action in ("committed", "timings_added")]
    assert [e.action for e in events] == ["timings_added", "committed"]
    assert events[0].detail == {
        "save_id": row.save_id,
        "timings": {"stall_s": 0.5, "write_s": 3.0},
    }
    assert events[1].detail["timings"] == {"write_s": 2.0, "commit_s": 0.25}


def test_add_timings_needs_the_row_of_that_save(catalog, run):
    with pytest.raises(CheckpointRecordNotFoundError) as caught:
        catalog.add_timings(run, 9, "nope", {"stall_s": 1})
    assert caught.value.found_save is None
    first = catalog.begin_checkpoint(run, 9, "/c/r/save-9")
    catalog.add_timings(run, 9, first.save_id, {"stage_s": 1})  # pending rows take them too
    catalog.mark_failed(run, 9, first.save_id, "crashed")
    second = catalog.begin_checkpoint(run, 9, "/c/r/save-9")
    assert catalog.get_checkpoint(run, 9).timings is None  # re-arming clears them
    with pytest.raises(CheckpointRecordNotFoundError) as caught:
        catalog.add_timings(run, 9, first.save_id, {"stall_s": 1})
    assert caught.value.found_save == second.save_id
    assert first.save_id in str(caught.value) and second.save_id in str(caught.value)
    with pytest.raises(RunNotFoundError):
        catalog.add_timings("other", 9, first.save_id, {"stall_s": 1})


def test_a_repair_recording_another_saves_marker_drops_the_old_timings(catalog, run):
    commit_step(catalog, run, 3)
    row = catalog.get_checkpoint(run, 3)
    catalog.add_timings(run, 3, row.save_id, {"total_s": 1.0})
    same, _ = catalog.upsert_committed(
        run, 3, row.path, save_id=row.save_id, epoch=0, bytes=5, file_count=3,
        manifest_checksum="crc-3",
    )  # fmt: skip
    assert same.timings == {"total_s": 1.0}
    other, _ = catalog.upsert_committed(
        run, 3, row.path, save_id="marker-save", epoch=0, bytes=5, file_count=3,
        manifest_checksum="crc-x",
    )  # fmt: skip
    assert other.save_id == "marker-save" and other.timings is None


@pytest.mark.parametrize(
    ("timings", "argument"),
    [
        ({"write": 1.0}, "timings phase"),
        ({"stall_s": -0.1}, "timings stall_s"),
        ({"stall_s": math.nan}, "timings stall_s"),
        ({"stall_s": math.inf}, "timings stall_s"),
        ({"stall_s": True}, "timings stall_s"),
        ({"stall_s": "1"}, "timings stall_s"),
        ({1: 1.0}, "timings phase"),
        ([("stall_s", 1.0)], "timings"),
    ],
)
def test_timings_are_known_phases_of_finite_seconds(catalog, run, timings, argument):
    row = catalog.begin_checkpoint(run, 2, "/c/r/save-2")
    calls = [
        lambda: catalog.add_timings(run, 2, row.save_id, timings),
        lambda: catalog.mark_committed(
            run, 2, row.save_id, bytes=1, file_count=1, manifest_checksum=None, timings=timings
        ),
        lambda: catalog.replica_committed(
            run, 2, save_id=row.save_id, bytes=1, timings=timings, **LOCAL
        ),
    ]
    for call in calls:
        with pytest.raises(InvalidValueError) as caught:
            call()
        assert caught.value.argument == argument
        assert "\n" not in str(caught.value)
    if argument == "timings phase":
        assert ", ".join(TIMING_PHASES) in str(caught.value)
    assert catalog.get_checkpoint(run, 2).state == "pending"  # nothing was written


def test_every_known_phase_is_accepted(catalog, run):
    row = catalog.begin_checkpoint(run, 2, "/c/r/save-2")
    phases = {phase: float(i) for i, phase in enumerate(TIMING_PHASES)}
    catalog.add_timings(run, 2, row.save_id, phases)
    assert catalog.get_checkpoint(run, 2).timings == phases
    assert set(TIMING_PHASES) == {
        "stall_s", "stage_s", "write_s", "commit_s", "total_s", "local_s", "upload_s",
        "memory_s", "replicate_s",
    }  # fmt: skip


# -- replica transitions -----------------------------------------------------------------------


def test_the_path_of_a_local_save_and_its_upload(catalog, run):
    local = started(catalog)
    assert isinstance(local, ReplicaRecord)
    assert (local.state, local.tier, local.host, local.location) == (
        "pending", "local", "node-1", "/local/r/save-5",
    )  # fmt: skip
    assert local.bytes is None and local.committed_at is None
    done = committed(catalog, timings={"local_s": 0.75})
    assert (done.state, done.bytes, done.timings) == ("committed", 100, {"local_s": 0.75})
    assert done.committed_at is not None and done.created_at == local.created_at
    shared = started(catalog, where=SHARED, location="s3://b/r/save-5")
    assert shared.state == "pending"
    up = committed(catalog, where=SHARED, size=100, timings={"upload_s": 2.0})
    assert up.state == "committed"
    assert catalog.replica_deleted("r", 5, **LOCAL)
    assert [(r.tier, r.state) for r in catalog.replicas("r")] == [
        ("local", "deleted"), ("save_dir", "committed"),
    ]  # fmt: skip
    assert replica_events(catalog) == [
        ("replica_begun", 5, "s1"),
        ("replica_committed", 5, "s1"),
        ("replica_begun", 5, "s1"),
        ("replica_committed", 5, "s1"),
        ("replica_deleted", 5, "s1"),
    ]
    assert ReplicaRecord.__dataclass_fields__.keys() == up.to_dict().keys()
    assert up.to_dict()["committed_at"] == up.committed_at.isoformat()


def test_repeats_are_idempotent_and_record_nothing(catalog, run):
    first = started(catalog)
    assert started(catalog) == first
    committed(catalog)
    assert committed(catalog, size=999).bytes == 100  # the first commit stands
    assert not catalog.replica_deleted("r", 5, tier="local", host="node-2")  # no such row
    started(catalog, step=6)
    failed(catalog, step=6)
    assert failed(catalog, step=6, reason="again").failure_reason == "disk full"
    assert [a for a, _, _ in replica_events(catalog)] == [
        "replica_begun", "replica_committed", "replica_begun", "replica_failed",
    ]  # fmt: skip


def test_a_failed_or_deleted_replica_is_rearmed_by_a_retried_or_new_save(catalog, run):
    started(catalog)
    failed(catalog)
    assert catalog.replicas("r")[0].failure_reason == "disk full"
    retry = started(catalog, save_id="s2")
    assert (retry.state, retry.save_id, retry.failure_reason) == ("pending", "s2", None)
    committed(catalog, save_id="s2", timings={"local_s": 1})
    assert catalog.replica_deleted("r", 5, **LOCAL)
    again = started(catalog, save_id="s3")
    assert (again.state, again.bytes, again.timings, again.committed_at) == (
        "pending", None, None, None,
    )  # fmt: skip
    rearms = [
        e.detail["previous"] for e in catalog.events(run="r") if e.action == "replica_rearmed"
    ]
    assert rearms == [
        {"state": "deleted", "save_id": "s2"},
        {"state": "failed", "save_id": "s1"},
    ]


@pytest.mark.parametrize("setup", [["fail"], ["commit", "delete"]])
def test_a_failed_or_deleted_copy_is_retried_under_the_same_save(catalog, run, setup):
    started(catalog)
    for action in setup:
        if action == "delete":
            assert catalog.replica_deleted("r", 5, **LOCAL)
        elif action == "commit":
            committed(catalog, timings={"local_s": 1})
        else:
            failed(catalog)
    retry = started(catalog, location="/local/r/save-5-again")
    assert (retry.state, retry.save_id, retry.location) == (
        "pending",
        "s1",
        "/local/r/save-5-again",
    )
    assert (retry.bytes, retry.timings, retry.failure_reason, retry.committed_at) == (
        None, None, None, None,
    )  # fmt: skip
    assert committed(catalog, size=7).state == "committed"
    previous = [
        e.detail["previous"] for e in catalog.events(run="r") if e.action == "replica_rearmed"
    ]
    assert previous == [{"state": "deleted" if "delete" in setup else "failed", "save_id": "s1"}]


def test_a_new_save_of_the_step_rearms_a_committed_replica_and_the_old_upload_loses(catalog, run):
    started(catalog, where=SHARED, location="s3://b/r/save-5")
    committed(catalog, where=SHARED)
    newer = started(catalog, where=SHARED, save_id="s2", location="s3://b/r/save-5")
    assert (newer.state, newer.save_id, newer.bytes) == ("pending", "s2", None)
    with pytest.raises(StateConflictError) as caught:
        committed(catalog, where=SHARED, save_id="s1")
    assert isinstance(caught.value, InvalidTransitionError)
    assert (caught.value.expected_save, caught.value.found_save) == ("s1", "s2")
    with pytest.raises(StateConflictError):
        failed(catalog, where=SHARED, save_id="s1")
    assert catalog.replicas("r")[0].state == "pending"


@pytest.mark.parametrize(
    ("setup", "call", "state", "where"),
    [
        # replica_started with the row's own save id once it is committed
        (["commit"], "start", "committed", LOCAL),
        (["commit"], "start", "committed", SHARED),
        # commit / fail of a row of this save that is not pending
        (["fail"], "commit", "failed", LOCAL),
        (["commit", "delete"], "commit", "deleted", LOCAL),
        # a committed copy is failed only on the local tier (below): never on save_dir
        (["commit"], "fail", "committed", SHARED),
        (["commit", "delete"], "fail", "deleted", LOCAL),
        (["commit", "delete"], "fail", "deleted", SHARED),
    ],
)
def test_illegal_transitions_are_refused_naming_the_state(catalog, run, setup, call, state, where):
    started(catalog, where=where)
    steps = {"commit": committed, "fail": failed}
    for action in setup:
        if action == "delete":
            assert catalog.replica_deleted("r", 5, **where)
        else:
            steps[action](catalog, where=where)
    before = catalog.replicas("r")
    attempt = {"start": started, "commit": committed, "fail": failed}[call]
    with pytest.raises(InvalidTransitionError) as caught:
        attempt(catalog, where=where)
    assert not isinstance(caught.value, StateConflictError)
    assert caught.value.state == state
    label = "local replica on host node-1" if where is LOCAL else "save_dir replica"
    assert label in str(caught.value)
    assert catalog.replicas("r") == before


def test_a_committed_local_replica_is_failed_with_its_reason(catalog, run):
    """A local copy that can never be uploaded (its attempt went stale): committed -> failed,
    once, with the reason; it keeps its size and commit time; another save's is refused."""
    started(catalog)
    done = committed(catalog, timings={"local_s": 0.5})
    row = failed(catalog, reason="StaleAttemptError: attempt epoch 1 is no longer current")
    assert (row.state, row.failure_reason) == (
        "failed",
        "StaleAttemptError: attempt epoch 1 is no longer current",
    )
    assert (row.bytes, row.committed_at, row.timings) == (100, done.committed_at, {"local_s": 0.5})
    assert failed(catalog, reason="again").failure_reason == row.failure_reason  # idempotent
    with pytest.raises(StateConflictError):
        failed(catalog, save_id="s2")
    assert catalog.replica_deleted("r", 5, **LOCAL) is False  # a failed row is not deleted
    assert [a for a, _, _ in replica_events(catalog)] == [
        "replica_begun", "replica_committed", "replica_failed",
    ]  # fmt: skip
    again = started(catalog, save_id="s2")  # a new save of the step re-arms it
    assert (again.state, again.failure_reason, again.bytes) == ("pending", None, None)


@pytest.mark.parametrize("setup", [[], ["fail"], ["commit", "delete"]])
def test_only_a_committed_replica_is_deleted(catalog, run, setup):
    started(catalog)
    for action in setup:
        if action == "delete":
            catalog.replica_deleted("r", 5, **LOCAL)
        else:
            failed(catalog)
    before = catalog.replicas("r")
    assert catalog.replica_deleted("r", 5, **LOCAL) is False
    assert catalog.replicas("r") == before


@pytest.mark.parametrize("how", ["gc", "missing"])
def test_the_save_dir_copy_goes_with_its_checkpoint_row_and_the_local_copy_stays(catalog, run, how):
    for step in (5, 6):
        commit_step(catalog, run, step)
        for where in (LOCAL, SHARED):
            started(catalog, step=step, where=where)
            committed(catalog, step=step, where=where)
    if how == "gc":
        (claimed,) = catalog.claim_for_deletion(run, [5], requested=True)
        assert catalog.mark_deleted(run, 5, claimed.claimed_by)
    else:
        assert catalog.mark_missing(run, 5)
    states = {(r.step, r.tier): r.state for r in catalog.replicas(run)}
    assert states == {
        (5, "local"): "committed",  # a node's own disk: its tier deletes and records it
        (5, "save_dir"): "deleted",
        (6, "local"): "committed",
        (6, "save_dir"): "committed",
    }


def test_commit_or_fail_without_a_start_is_replica_not_found(catalog, run):
    for call in (committed, failed):
        with pytest.raises(ReplicaNotFoundError) as caught:
            call(catalog)
        assert isinstance(caught.value, CheckpointRecordNotFoundError)
        assert (caught.value.tier, caught.value.host, caught.value.step) == ("local", "node-1", 5)
        assert "replica_started" in str(caught.value)


def test_replicas_need_their_run(catalog):
    with pytest.raises(RunNotFoundError):
        started(catalog)
    with pytest.raises(RunNotFoundError):
        catalog.replicas("r")


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"tier": "ssd"}, "tier"),
        ({"tier": "save_dir", "host": "node-1"}, "host"),
        ({"host": ""}, "host"),
        ({"host": "n" * 256}, "host"),
        ({"host": "a\x00b"}, "host"),
        ({"location": "s3://key:secret@bucket/r/save-5"}, "location"),
        ({"location": ""}, "location"),
        ({"save_id": "a/b"}, "save_id"),
        ({"step": -1}, "step"),
    ],
)
def test_bad_replica_arguments_are_refused_before_the_database(catalog, run, kwargs, argument):
    values = {"step": 5, "location": "/l/r/save-5", "save_id": "s1", **LOCAL, **kwargs}
    step = values.pop("step")
    with pytest.raises(InvalidValueError) as caught:
        catalog.replica_started("r", step, **values)
    assert caught.value.argument == argument
    assert "secret" not in str(caught.value)
    assert catalog.replicas("r") == []


def test_replica_commit_arguments_are_checked(catalog, run):
    started(catalog)
    for bad in (-1, None, True, 2**63):
        with pytest.raises(InvalidValueError):
            committed(catalog, size=bad)
    with pytest.raises(InvalidValueError):
        failed(catalog, reason="")
    assert catalog.replicas("r")[0].state == "pending"


def test_a_long_failure_reason_is_kept_short_and_nul_safe(catalog, run):
    started(catalog)
    row = failed(catalog, reason="x\x00" + "y" * 5000)
    assert row.failure_reason.startswith("x\\x00y") and len(row.failure_reason) == 2000


# -- queries -----------------------------------------------------------------------------------


def test_replicas_are_listed_by_step_tier_and_host_and_filtered(catalog, run):
    catalog.ensure_run("other", "/c")
    catalog.replica_started(
        "other", 1, tier="local", host="node-1", location="/l/o/save-1", save_id="o1"
    )
    for step in (20, 10):
        for where in (SHARED, {"tier": "local", "host": "node-2"}, LOCAL):
            started(catalog, step=step, save_id=f"s{step}", where=where)
    committed(catalog, step=10, save_id="s10")
    failed(catalog, step=20, save_id="s20", where=SHARED)

    def listed(**filters):
        return [(r.step, r.tier, r.host) for r in catalog.replicas("r", **filters)]

    assert listed() == [
        (10, "local", "node-1"), (10, "local", "node-2"), (10, "save_dir", ""),
        (20, "local", "node-1"), (20, "local", "node-2"), (20, "save_dir", ""),
    ]  # fmt: skip
    assert listed(step=20) == [
        (20, "local", "node-1"),
        (20, "local", "node-2"),
        (20, "save_dir", ""),
    ]
    assert listed(tier="save_dir") == [(10, "save_dir", ""), (20, "save_dir", "")]
    assert listed(host="node-2") == [(10, "local", "node-2"), (20, "local", "node-2")]
    assert listed(host="") == [(10, "save_dir", ""), (20, "save_dir", "")]
    assert listed(states=["committed"]) == [(10, "local", "node-1")]
    assert listed(states="failed") == [(20, "save_dir", "")]
    assert listed(states=("committed", "failed"), tier="local") == [(10, "local", "node-1")]
    assert listed(states=[]) == []
    assert listed(step=30) == []
    assert [r.run for r in catalog.replicas("other")] == ["other"]
    with pytest.raises(InvalidValueError):
        catalog.replicas("r", states=["stale"])  # a checkpoint state, not a replica one
    with pytest.raises(InvalidValueError):
        catalog.replicas("r", tier="nvme")


def test_replicas_of_a_run_use_the_unique_index(catalog_url, catalog, run):
    started(catalog)
    engine = create_engine(catalog_url)
    query = str(
        replicas.of_run(1, None, None, None, None).compile(
            dialect=engine.dialect, compile_kwargs={"literal_binds": True}
        )
    )
    try:
        with engine.connect() as connection:
            if engine.dialect.name == "sqlite":
                plan = connection.execute(text(f"EXPLAIN QUERY PLAN {query}")).all()
                details = " ".join(str(row[-1]) for row in plan)
                # SQLite names a unique constraint's index itself
                assert "USING INDEX sqlite_autoindex_checkpoint_replicas_1 (run_id=?)" in details
                assert "TEMP B-TREE" not in details
            else:
                connection.execute(text("SET enable_seqscan = off"))
                plan = connection.execute(text(f"EXPLAIN {query}")).all()
                details = " ".join(str(row[0]) for row in plan)
                assert "uq_checkpoint_replicas_run_id_step_tier_host" in details
                assert "Sort" not in details
    finally:
        engine.dispose()


def test_deleting_a_run_row_deletes_its_replicas(catalog_url, catalog, run):
    started(catalog)
    engine = create_engine(catalog_url)
    try:
        with engine.begin() as connection:
            if engine.dialect.name == "sqlite":
                connection.execute(text("PRAGMA foreign_keys = ON"))
            connection.execute(text("DELETE FROM runs WHERE name = 'r'"))
            left = connection.execute(text("SELECT count(*) FROM checkpoint_replicas")).scalar()
        assert left == 0
    finally:
        engine.dispose()


# -- concurrency -------------------------------------------------------------------------------

ROUNDS = 12


def test_an_old_upload_committing_races_a_new_save_and_one_wins_cleanly(postgres_url, tmp_path):
    from tests import servers

    with servers.postgres_database(postgres_url) as url:
        from zephon.catalog import Catalog

        with Catalog(url) as catalog:
            catalog.ensure_run("r", "/c")
        uploads, saves = workers.run_in_processes(
            [
                (workers.upload_commits, (url, "r", ROUNDS)),
                (workers.new_save_starts, (url, "r", ROUNDS)),
            ]
        )
        with Catalog(url) as catalog:
            rows = catalog.replicas("r")
            rearmed = {
                e.step: e.detail["previous"]
                for e in catalog.events(run="r", limit=1000)
                if e.action == "replica_rearmed"
            }
            commits = {e.step for e in catalog.events(run="r", limit=1000)
                       if e.action == "replica_committed"}  # fmt: skip
    assert [(r.step, r.state, r.save_id) for r in rows] == [
        (step, "pending", f"new-{step}") for step in range(ROUNDS)
    ]
    for step in range(ROUNDS):
        # Either the old upload committed first and the new save re-armed its committed row,
        # or the new save re-armed the pending row first and the upload lost: never both.
        if uploads[step] == "committed":
            assert rearmed[step] == {"state": "committed", "save_id": f"old-{step}"}
            assert step in commits
        else:
            assert uploads[step] == "lost"
            assert rearmed[step] == {"state": "pending", "save_id": f"old-{step}"}
            assert step not in commits
    assert saves == ["pending"] * ROUNDS


def test_concurrent_add_timings_lose_no_phase(catalog_url):
    import threading

    from zephon.catalog import Catalog

    with Catalog(catalog_url) as catalog:
        catalog.ensure_run("r", "/c")
        row = catalog.begin_checkpoint("r", 1, "/c/r/save-1")
    catalogs = [Catalog(catalog_url) for _ in TIMING_PHASES]
    barrier = threading.Barrier(len(catalogs))
    errors = []

    def add(index: int) -> None:
        try:
            barrier.wait(30)
            for _ in range(5):
                catalogs[index].add_timings("r", 1, row.save_id, {TIMING_PHASES[index]: index})
        except Exception as exc:  # reported below: the assertion names it
            errors.append(exc)

    in_threads(add, catalogs)
    assert errors == []
    with Catalog(catalog_url) as catalog:
        timings = catalog.get_checkpoint("r", 1).timings
    assert timings == {phase: float(i) for i, phase in enumerate(TIMING_PHASES)}
