"""Save on preemption with real rank processes (docs/manager.md, "Save on preemption"): a tiny
deterministic job (``tests.zephon.emergency.train``, 2 gloo ranks) gets SIGTERM at a random
moment, from a seeded RNG: to every rank as a scheduler sends it, or to one rank only. Every
rank exits with 143 after one emergency save of the same step, rank 0 logs the line, the
catalog row says ``trigger: emergency`` (and an ``emergency_save`` event), and a new start
resumes from it: every step's loss of the interrupted start followed by the resumed one
equals an uninterrupted run's, bit for bit. With save_dir local and on S3 (moto), directly
and through the local tier, a second SIGTERM during the save, and a grace period too short
for the upload.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.zephon.emergency.jobs import EMERGENCY_LINE, start
from zephon.catalog import Catalog
from zephon.storage import CheckpointStore

pytestmark = pytest.mark.slow

TOTAL = 60  # steps: a signal sent within the first seconds always lands before the end
STEP_S = 0.03  # the pause between the two halves of each optimizer update
RUN = "pre"


def job_config(tmp: Path, checkpointing: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "checkpointing": checkpointing,
        "run": RUN,
        "total_steps": TOTAL,
        "step_s": STEP_S,
        "losses": str(tmp / "losses"),
        **more,
    }


def losses(tmp: Path) -> list[str]:
    """Each rank's losses file, in rank order."""
    return [(tmp / f"losses.{rank}").read_text() for rank in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[str]:
    """An uninterrupted run's losses, per rank (no signal: it saves only at the last step)."""
    tmp = tmp_path_factory.mktemp("reference")
    checkpointing = {"save_dir": str(tmp / "ckpt"), "period_steps": "last_step"}
    results = start(job_config(tmp, checkpointing)).finish()
    for code, _, err in results:
        assert code == 0, err[-4000:]
    shown = losses(tmp)
    assert all(len(text.splitlines()) == TOTAL for text in shown)
    return shown


def local_place(tmp: Path) -> dict[str, Any]:
    return {"save_dir": str(tmp / "ckpt"), "catalog_url": f"sqlite:///{tmp}/catalog.db"}


def preempt(
    tmp: Path,
    place: dict[str, Any],
    *,
    seed: int,
    targets: tuple[int, ...] = (0, 1),
    again: bool = False,
    grace_s: float = 60,
    **options: Any,
) -> tuple[int, Any]:
    """Start the job, SIGTERM ``targets`` at a random moment drawn from ``seed`` (``again``:
    once more during the emergency save), check that every rank exited with 143 after the
    same emergency save; the step saved and the regex match of rank 0's line."""
    checkpointing = {
        **place,
        # with ``again`` the emergency save is the only save, its state capture slowed down
        "period_steps": "last_step" if again else 10,
        "num_to_keep": 2,
        "emergency_save": {"signals": ["SIGTERM"], "grace_s": grace_s},
        **options,
    }
    job = start(job_config(tmp, checkpointing, slow_save_s=1.0 if again else 0))
    job.wait_for(0, "STEP 1")
    delay = random.Random(seed).uniform(0.0, 1.5)
    time.sleep(delay)
    job.signal(targets)
    if again:
        job.wait_for(0, "IN_SAVE")  # the emergency save is capturing the state
        job.signal(targets)
    results = job.finish()
    for rank, (code, _, err) in enumerate(results):
        assert code == 143, f"rank {rank} exited {code} (delay {delay:.2f} s):\n{err[-4000:]}"
    lines = [m for m in map(EMERGENCY_LINE.search, results[0][2].splitlines()) if m]
    assert len(lines) == 1, results[0][2][-4000:]
    line = lines[0]
    step = int(line["step"])
    assert line["signal"] == "SIGTERM"
    for rank, text in enumerate(losses(tmp)):  # every rank stopped after the step it saved
        assert text.splitlines()[-1].split()[0] == str(step), (rank, text[-200:])
    if again:
        assert "SIGTERM again: ignored" in results[targets[0]][2]
    return step, line


def resume(tmp: Path, place: dict[str, Any], step: int) -> None:
    """Start the job again (no signal): it resumes after ``step`` and runs to the end."""
    checkpointing = {**place, "period_steps": 10, "num_to_keep": 2}
    job = start(job_config(tmp, checkpointing))
    assert job.wait_for(0, "RESUMED") == f"RESUMED {step + 1}\n"
    for code, _, err in job.finish():
        assert code == 0, err[-4000:]


def check_catalog(place: dict[str, Any], step: int) -> None:
    """The checkpoint's row says emergency (its metadata), and the event is there."""
    with Catalog(place["catalog_url"]) as catalog:
        row = catalog.get_checkpoint(RUN, step)
        assert row.state == "committed"
        assert row.metadata is not None
        assert (row.metadata["trigger"], row.metadata["signal"]) == ("emergency", "SIGTERM")
        events = [e for e in catalog.events(run=RUN, limit=1000) if e.action == "emergency_save"]
        assert [(e.step, e.detail["signal"]) for e in events] == [(step, "SIGTERM")]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigterm_to_every_rank_saves_and_resumes_bit_for_bit(seed, tmp_path, reference):
    place = local_place(tmp_path)
    step, line = preempt(tmp_path, place, seed=seed)
    assert line["url"] == f"{place['save_dir']}/{RUN}/save-{step}"
    assert line["rest"] == ""
    check_catalog(place, step)
    resume(tmp_path, place, step)
    assert losses(tmp_path) == reference


def test_sigterm_to_one_rank_saves_every_rank(tmp_path, reference):
    place = local_place(tmp_path)
    step, _ = preempt(tmp_path, place, seed=4, targets=(1,))
    check_catalog(place, step)
    resume(tmp_path, place, step)
    assert losses(tmp_path) == reference


def test_on_s3_through_the_local_tier(tmp_path, reference, s3_place):
    """The emergency save commits in the local tier and is uploaded within grace_s."""
    step, line = preempt(tmp_path, s3_place, seed=5, local_dir=str(tmp_path / "local"))
    assert line["uploaded"] and line["rest"] == ""
    assert line["url"] == f"{s3_place['save_dir']}/{RUN}/save-{step}"
    check_catalog(s3_place, step)
    resume(tmp_path, {**s3_place, "local_dir": str(tmp_path / "local")}, step)
    assert losses(tmp_path) == reference


def test_a_second_sigterm_during_the_save_is_ignored(tmp_path, reference, s3_place):
    step, _ = preempt(tmp_path, s3_place, seed=6, again=True)
    store = CheckpointStore(s3_place["save_dir"], s3_place["storage_options"])
    try:
        report = store.run(RUN).verify(step, deep=True)
        assert report.ok, report
    finally:
        store.close()
    check_catalog(s3_place, step)
    resume(tmp_path, s3_place, step)
    assert losses(tmp_path) == reference


def test_grace_too_short_for_the_upload_says_so_and_the_next_start_resumes(
    tmp_path, reference, s3_place
):
    local = str(tmp_path / "local")
    step, line = preempt(tmp_path, s3_place, seed=7, grace_s=0.001, local_dir=local)
    assert not line["uploaded"]
    assert "did not finish within grace_s = 0.001 s" in line["rest"]
    assert line["url"].startswith(local)
    resume(tmp_path, {**s3_place, "local_dir": local}, step)
    assert losses(tmp_path) == reference
