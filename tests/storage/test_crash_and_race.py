"""Writers in separate processes: killed with SIGKILL at random and at exact points around the
marker, and racing each other to commit one step."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import backends_with, make_backend
from zephon.storage import CheckpointStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILL_POINTS = ["before-marker", "marker-in-flight", "after-marker"]


def spawn(args: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.storage.writer_child", json.dumps(args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_all_or_nothing(store: CheckpointStore, run: str, step: int, files: int) -> bool:
    """The invariant: a step that lists as committed verifies completely; returns committed."""
    committed = step in store.run(run).committed_steps()
    if committed:
        manifest = store.run(run).read_manifest(step)
        assert manifest.file_count == files, "a committed checkpoint lists every file"
        report = store.run(run).verify(step, deep=True)
        assert report.ok, report.problems
    return committed


def resave_succeeds(store: CheckpointStore, run: str, step: int) -> None:
    with store.run(run).begin(step) as writer:
        writer.write_bytes("fresh.bin", b"after the crash")
        writer.commit()
    assert [f.name for f in store.run(run).read_manifest(step).files] == ["fresh.bin"]
    assert store.run(run).verify(step, deep=True).ok


@pytest.fixture(params=backends_with(cross_process=True))
def crash_backend(request, tmp_path):
    return make_backend(request.param, request, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", KILL_POINTS)
def test_sigkill_at_an_exact_point_of_the_commit(crash_backend, kill_at):
    backend = crash_backend
    store = backend.open_store()
    args = dict(url=backend.url, storage_options=backend.storage_options, run="r", step=1)
    proc = spawn({**args, "files": 6, "kill_at": kill_at})
    proc.wait(120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    committed = assert_all_or_nothing(store, "r", 1, files=6)
    assert committed == (kill_at == "after-marker")
    if not committed:
        assert {o.step for o in store.orphans(0, runs=["r"])} == {1}
        resave_succeeds(store, "r", 1)


@pytest.mark.slow
def test_sigkill_at_random_moments_never_lists_a_torn_checkpoint(crash_backend):
    backend = crash_backend
    rounds = {"local": 16, "s3": 10}.get(backend.name, 5)
    files = 12
    store = backend.open_store()
    base = dict(url=backend.url, storage_options=backend.storage_options, run="r", files=files)
    rng = random.Random(1234)
    outcomes = []
    for step in range(rounds):
        proc = spawn({**base, "step": step})
        # Kill after a random number of progress events, plus a random sub-event delay, so the
        # kill lands before, between and during file writes and around the marker.
        events_before_kill = rng.randint(1, files + 3)
        for seen, _event in enumerate(proc.stdout, start=1):
            if seen >= events_before_kill:
                time.sleep(rng.uniform(0, 0.01))
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        outcomes.append(assert_all_or_nothing(store, "r", step, files=files))
        if not outcomes[-1]:
            resave_succeeds(store, "r", step)
    assert False in outcomes, "some kills should land before the marker"


@pytest.mark.slow
@pytest.mark.parametrize("name", backends_with(cross_process=True, one_winner_races=True))
def test_two_writers_racing_to_commit_one_step_exactly_one_wins(name, request, tmp_path):
    backend = make_backend(name, request, tmp_path)
    store = backend.open_store()
    for step in range(4):
        sync = tmp_path / f"sync-{step}"
        sync.mkdir()
        args = dict(url=backend.url, storage_options=backend.storage_options, run="r", step=step)
        procs = {
            tag: spawn({**args, "tag": tag, "files": 4, "sync_dir": str(sync)})
            for tag in ("a", "b")
        }
        _wait_files(sync, ["begun-a", "begun-b"])
        (sync / "write").touch()
        _wait_files(sync, ["written-a", "written-b"])
        (sync / "commit").touch()
        results = {}
        for tag, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            results[tag] = out.strip().splitlines()[-1]
        winners = [tag for tag, last in results.items() if last == "committed"]
        assert len(winners) == 1, results
        loser = "b" if winners == ["a"] else "a"
        assert results[loser] == "conflict CommitConflictError"
        manifest = store.run("r").read_manifest(step)
        assert manifest.metadata["tag"] == winners[0]
        assert {f.name.split("/")[0] for f in manifest.files} == {winners[0]}
        assert store.run("r").verify(step, deep=True).ok


def _wait_files(directory, names, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not all((directory / n).exists() for n in names):
        assert time.monotonic() < deadline, f"children never reached {names}"
        time.sleep(0.01)
