"""``zephon goodput RUN``: a run built by real ``CheckpointManager`` saves and two attempts
(the first one's latest checkpoint damaged, so the restart rolls back and redoes work), in a
SQLite and a PostgreSQL catalog; the command's figures are those the records give."""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.zephon.saves import flip_a_tensor_byte
from tests.zephon.test_manager import Counter, build, state_of
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig
from zephon.goodput import from_catalog

#: a step of the tiny job: long enough that the figures are far from 0
STEP_S = 0.05


def attempt(config: CheckpointingConfig, first: int, last: int, *, finish: bool) -> int | None:
    """One start of the job: resume, train and save from there to ``last``; returns the step
    it resumed from."""
    model, optimizer, scheduler = build()
    counter = Counter()
    with CheckpointManager(config, run_name="r", total_steps=8) as manager:
        resume = manager.load_latest(state_of(model, optimizer, scheduler, counter))
        for step in range(max(first, resume.next_step), last + 1):
            time.sleep(STEP_S)
            counter.value += 1
            manager.maybe_save(step, state_of(model, optimizer, scheduler, counter))
        if finish:
            manager.finish()
        return resume.step


@pytest.fixture
def run_with_a_rollback(tmp_path, catalog_url) -> CheckpointingConfig:
    """Attempt 1 saves steps 2, 4, 6 and dies; the restart finds step 6 damaged: its first
    attempt (2) chose 6, so it sets 6 aside and registers again (3), resuming from 4 (the
    time from step 4's save to the death is redone), and finishes the run."""
    config = CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"), period_steps=2, catalog_url=catalog_url
    )
    assert attempt(config, 1, 6, finish=False) is None
    with CheckpointManager(config, run_name="r") as manager:
        flip_a_tensor_byte(manager.store.run("r").reader(6).path)
    assert attempt(config, 1, 8, finish=True) == 4
    return config


def test_goodput_reports_each_part_of_the_wall_time(run_with_a_rollback, cli):
    code, out, err = cli("goodput", "r", "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert (report["run"], report["attempts"], report["restarts"]) == ("r", 3, 2)
    parts = [report[k] for k in ("productive_s", "lost_s", "overhead_s", "stall_s")]
    assert math.isclose(sum(parts), report["wall_s"], abs_tol=1e-6)
    assert all(part >= 0 for part in parts)
    # attempt 1 trained two steps after step 4's save before step 6's: redone by attempt 3
    assert report["lost_s"] >= STEP_S
    assert report["stall_s"] > 0  # the saves were timed
    assert report["productive_s"] >= 6 * STEP_S
    assert report["goodput"] == pytest.approx(report["productive_s"] / report["wall_s"])
    with Catalog(run_with_a_rollback.catalog_url) as catalog:
        assert from_catalog(catalog, "r").to_dict() == report
    # the plain report: one line per figure, no terminal codes
    code, out, err = cli("goodput", "r")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("run r: 3 attempt(s), 2 restart(s), ")
    assert [line.split()[0] for line in lines[1:]] == [
        "wall",
        "productive",
        "lost",
        "restart",
        "checkpoint",
        "goodput",
    ]
    assert lines[-1].rstrip().endswith("%")
    assert "\x1b" not in out


def test_goodput_of_an_unknown_run_is_a_catalog_error(catalog, cli):
    code, out, err = cli("goodput", "nope")
    assert code == 5 and out == ""
    assert err.startswith("zephon: error: ") and "nope" in err and len(err.splitlines()) == 1


def test_goodput_needs_a_valid_run_name(usage):
    code, _, err = usage("goodput", "bad/name")
    assert code == 2 and "invalid run name" in err


def test_goodput_loads_neither_torch_nor_storage(tmp_path, local_backend):
    from tests.test_import_cost import _saved_run, loaded_by

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog(url) as catalog:
        _saved_run(catalog, local_backend, "r")
    code = (
        "from zephon.cli import main\n"
        "import sys\n"
        "code = main(['goodput', 'r'])\n"
        "assert code == 0, code\n"
        "assert 'zephon.storage.backends' not in sys.modules\n"
    )
    assert loaded_by(code, {"ZEPHON_CATALOG_URL": url}) <= {"sqlalchemy", "alembic"}


@pytest.mark.slow
def test_a_killed_job_s_silent_end_counts_as_restart_overhead(tmp_path, catalog_url, cli):
    """A job SIGKILLed while it trains after its last save: nothing records the steps it
    trained since, so its end is its last record (docs/goodput.md) and the time from there to
    the restart's first progress is restart overhead."""
    import signal
    import subprocess
    import sys

    from tests.ranks import ROOT

    save_dir = str(tmp_path / "ckpt")
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.zephon.goodput.killed_job", save_dir, catalog_url],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "saved 2"
        assert child.stdout.readline().strip() == "saved 4"
        time.sleep(1.0)  # it trains on, unrecorded
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    config = CheckpointingConfig(save_dir=save_dir, period_steps=2, catalog_url=catalog_url)
    assert attempt(config, 1, 8, finish=True) == 4
    code, out, _ = cli("goodput", "r", "--json")
    report = json.loads(out)
    assert code == 0 and (report["attempts"], report["restarts"]) == (2, 1)
    assert report["overhead_s"] >= 1.0
    assert report["lost_s"] < 1.0  # only what a record shows: step 4's save was kept
    parts = [report[k] for k in ("productive_s", "lost_s", "overhead_s", "stall_s")]
    assert math.isclose(sum(parts), report["wall_s"], abs_tol=1e-6)
