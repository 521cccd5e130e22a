"""Several ``zephon gc`` processes beside a saving process, and gc processes killed mid-way,
on SQLite and PostgreSQL with checkpoints on S3 (moto)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.zephon.saves import save_step, start
from tests.zephon.test_composition import make_run
from zephon.catalog import Catalog
from zephon.storage.backend import list_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZEPHON = os.path.join(os.path.dirname(sys.executable), "zephon")


def gc_argv(catalog_url: str, options: dict, *extra: str) -> list[str]:
    return [
        ZEPHON,
        "gc",
        "--catalog",
        catalog_url,
        "--storage-options",
        json.dumps(options),
        "--json",
        *extra,
    ]


def assert_deleted_rows_are_gone(catalog: Catalog, location) -> None:
    for row in catalog.list_checkpoints(location.name, states="deleted"):
        path = location.runstore.checkpoint_path(row.step)
        assert list_files(location.store.location, path) == [], f"step {row.step} left files"


@pytest.mark.slow
def test_three_gc_processes_beside_a_saving_job(catalog_url, s3_backend):
    keep = 3
    with Catalog(catalog_url) as catalog:
        location = make_run(catalog, s3_backend, num_to_keep=keep)
    options = s3_backend.storage_options
    seconds = 12
    committer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.zephon.gc_children",
            "commit",
            json.dumps(
                {
                    "catalog": catalog_url,
                    "run": "r",
                    "storage_options": options,
                    "num_to_keep": keep,
                    "seconds": seconds,
                }
            ),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    failures: list[str] = []
    runs = [0, 0, 0]

    def gc_loop(index: int) -> None:
        while committer.poll() is None:
            done = subprocess.run(
                gc_argv(catalog_url, options, "--grace", "1h"),
                capture_output=True,
                text=True,
                timeout=120,
            )
            runs[index] += 1
            report = json.loads(done.stdout) if done.stdout.strip() else None
            if done.returncode != 0 or report is None or report["problems"]:
                failures.append(f"gc exit {done.returncode}: {done.stdout} {done.stderr}")
                return

    threads = [threading.Thread(target=gc_loop, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    out, err = committer.communicate(timeout=seconds + 120)
    for thread in threads:
        thread.join(timeout=180)

    assert committer.returncode == 0, err
    assert not failures, failures
    committed = [int(line.split()[1]) for line in out.splitlines()]
    assert len(committed) >= 10 and min(runs) >= 2, (len(committed), runs)

    with Catalog(catalog_url) as catalog:
        rows = {r.step: r for r in catalog.list_checkpoints("r")}
        states = {r.state for r in rows.values()}
        assert states <= {"committed", "deleted"}, states  # nothing pending, failed or stuck
        newest = committed[-keep:]
        assert [s for s, r in sorted(rows.items()) if r.state == "committed"][-keep:] == newest
        for step in newest:
            assert location.store.run("r").verify(step, deep=True).ok
        assert_deleted_rows_are_gone(catalog, location)
        events = catalog.events(run="r", limit=100_000)
        assert not [e for e in events if e.action in {"failed", "expired", "reclaimed"}]
        deleted = {e.step for e in events if e.action == "deleted"}
        assert deleted and len(deleted) == len([e for e in events if e.action == "deleted"])


@pytest.mark.slow
def test_a_gc_killed_at_random_points_is_finished_by_the_next(catalog_url, s3_backend):
    keep = 2
    with Catalog(catalog_url) as catalog:
        location = make_run(catalog, s3_backend, num_to_keep=keep)
        attempt = start(location, catalog)
        for step in range(24):
            save_step(attempt, step, catalog)
    options = s3_backend.storage_options
    rng = random.Random(7)
    for _ in range(5):
        proc = subprocess.Popen(
            gc_argv(catalog_url, options, "--lease", "1s"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(0.5, 2.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        # whatever the kill interrupted, the newest checkpoints are intact
        with Catalog(catalog_url) as catalog:
            for step in (22, 23):
                assert catalog.get_checkpoint("r", step).state == "committed"
                assert location.store.run("r").verify(step, deep=True).ok
    time.sleep(1.1)  # let the killed gc's claims pass their lease
    done = subprocess.run(
        gc_argv(catalog_url, options, "--lease", "1s"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    with Catalog(catalog_url) as catalog:
        states = {r.step: r.state for r in catalog.list_checkpoints("r")}
        assert states == {s: ("committed" if s >= 22 else "deleted") for s in range(24)}
        assert_deleted_rows_are_gone(catalog, location)
    assert [s.step for s in location.store.run("r").list_steps()] == [22, 23]
