"""A ``zephon gc`` rerun finishes what an earlier pass left: deletes that failed part-way on S3
(moto behind the fault proxy), a pass killed mid-delete; and exits 75 naming what remains when
the claims belong to a process it cannot judge. SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import time

import pytest

from tests.faults import FaultProxy
from tests.zephon.saves import save_step, start
from tests.zephon.test_composition import make_run
from tests.zephon.test_gc_processes import assert_deleted_rows_are_gone, gc_argv
from zephon.catalog import Catalog

pytestmark = pytest.mark.slow

KEEP = 2
STEPS = range(6)
#: what ``num_to_keep=2`` over steps 0..5 leaves
FINISHED = {step: ("committed" if step >= 4 else "deleted") for step in STEPS}


def six_checkpoints(catalog_url: str, backend):
    with Catalog(catalog_url) as catalog:
        location = make_run(catalog, backend, num_to_keep=KEEP)
        attempt = start(location, catalog)
        for step in STEPS:
            save_step(attempt, step, catalog)
    return location


def states(catalog_url: str) -> dict[int, str]:
    with Catalog(catalog_url) as catalog:
        return {row.step: row.state for row in catalog.list_checkpoints("r")}


def through(proxy: FaultProxy, backend) -> dict:
    return {**backend.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}


def gc(catalog_url: str, options: dict, *extra: str) -> tuple[int, dict, str]:
    done = subprocess.run(
        gc_argv(catalog_url, options, *extra), capture_output=True, text=True, timeout=120
    )
    return done.returncode, json.loads(done.stdout or "null"), done.stderr


def assert_finished(catalog_url: str, location) -> None:
    assert states(catalog_url) == FINISHED
    with Catalog(catalog_url) as catalog:
        assert_deleted_rows_are_gone(catalog, location)
        assert not catalog.list_checkpoints("r", states="deleting")
    assert [s.step for s in location.store.run("r").list_steps()] == [4, 5]


def test_a_rerun_finishes_at_once_the_deletes_a_failed_pass_left_half_done(
    catalog_url, s3_backend, s3
):
    location = six_checkpoints(catalog_url, s3_backend)
    with FaultProxy(s3.endpoint_url, seed=7) as proxy:
        # The batched delete removes every marker (POST ?delete), lists the run for the
        # payload (GET prefix=<run>/), then removes it: the listing fails, so the markers are
        # gone and the payloads stay.
        proxy.fail(method="GET", path=r"prefix=ckpt%2Fr%2F&", status=403, count=1)
        code, report, _ = gc(catalog_url, through(proxy, s3_backend))
        assert proxy.pending_rules == 0

    assert code == 3 and len(report["problems"]) == 1, report
    assert report["deleted"] == []
    assert [(r["run"], r["step"], r["lease_expires"]) for r in report["remaining"]] == [
        ("r", step, None) for step in range(4)
    ]
    with Catalog(catalog_url) as catalog:
        held = catalog.list_checkpoints("r", states="deleting")
        assert [row.step for row in held] == [0, 1, 2, 3]
        assert all(row.claimed_at is None for row in held)  # given back, not leased
        released = [e for e in catalog.events(run="r") if e.action == "released"]
        assert sorted(e.step for e in released) == [0, 1, 2, 3]
    assert location.store.run("r").committed_steps() == [4, 5]
    assert [s.step for s in location.store.run("r").list_steps()] == list(STEPS)  # payloads stay

    # the default one-hour lease does not hold the rerun back
    code, report, err = gc(catalog_url, s3_backend.storage_options)
    assert code == 0, (report, err)
    assert sorted(d["step"] for d in report["deleted"]) == [0, 1, 2, 3]
    assert report["remaining"] == [] and report["problems"] == []
    assert_finished(catalog_url, location)


def test_a_rerun_finishes_at_once_what_a_killed_pass_left(catalog_url, s3_backend, s3):
    location = six_checkpoints(catalog_url, s3_backend)
    with FaultProxy(s3.endpoint_url, seed=7) as proxy:
        # The batched delete is answered 503 and retried with backoff: the pass is killed
        # while it retries, holding its claims with an hour-long lease.
        proxy.fail(method="POST", path=r"\?delete", status=503, count=1000)
        killed = subprocess.Popen(
            gc_argv(catalog_url, through(proxy, s3_backend)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not proxy.outcomes("fail") and time.monotonic() < deadline:
            time.sleep(0.01)
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(30) == -signal.SIGKILL
        assert proxy.outcomes("fail"), "the pass never reached its delete"
    with Catalog(catalog_url) as catalog:
        held = catalog.list_checkpoints("r", states="deleting")
        assert [row.step for row in held] == [0, 1, 2, 3]
        assert all(row.claimed_at is not None for row in held)  # the dead pass's lease
        assert all(f":{killed.pid}/" in row.claimed_by for row in held)

    code, report, err = gc(catalog_url, s3_backend.storage_options)
    assert code == 0, (report, err)
    assert sorted(d["step"] for d in report["deleted"]) == [0, 1, 2, 3]
    assert_finished(catalog_url, location)
    with Catalog(catalog_url) as catalog:
        actions = [e.action for e in catalog.events(run="r") if e.step == 0]
        assert {"released", "reclaimed", "deleted"} <= set(actions)


def test_claims_of_a_process_gc_cannot_judge_make_it_exit_75_until_their_lease_ends(
    catalog_url, local_backend
):
    location = six_checkpoints(catalog_url, local_backend)
    with Catalog(catalog_url, actor="gc@another-host:4242") as elsewhere:
        held = elsewhere.claim_for_deletion("r", [0, 1, 2, 3])
    assert [row.step for row in held] == [0, 1, 2, 3]
    token = held[0].claimed_by

    text_output = [arg for arg in gc_argv(catalog_url, {}) if arg != "--json"]
    done = subprocess.run(text_output, capture_output=True, text=True, timeout=120)
    assert done.returncode == 75, (done.stdout, done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("remaining:")]
    expires = (held[0].claimed_at + dt.timedelta(hours=1)).isoformat(timespec="seconds")
    assert lines == [
        f"remaining: 4 deletion(s) not finished: run r steps 0, 1, 2, 3 (claimed by {token}, "
        f"a process this host cannot judge, lease expires {expires}: the first gc after that "
        "finishes them)"
    ]
    assert states(catalog_url)[0] == "deleting"

    time.sleep(1.1)
    code, report, err = gc(catalog_url, {}, "--lease", "1s")
    assert code == 0, (report, err)
    assert_finished(catalog_url, location)
