"""``emergency_save.when: now`` with real rank processes (docs/manager.md, "Save on preemption"):
the tiny deterministic job of ``tests.zephon.emergency.train`` on 2 gloo ranks, with long steps
(each optimizer update pauses ``STEP_S`` half-way), gets SIGTERM on ONE rank in the middle of a
step, at a moment drawn from a seeded RNG. Every rank saves the state of the last step boundary
at once and exits 143: the step under way never completes (its loss is never written), rank 0
logs the line, the catalog row says ``emergency``, and a new start resumes after the saved step:
the losses of the interrupted start up to the saved step followed by the resumed start's equal
an uninterrupted run's, bit for bit. A second SIGTERM during the save does not tear it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.zephon.emergency.jobs import EMERGENCY_LINE, start
from tests.zephon.emergency.test_preemption import RUN, check_catalog, local_place
from zephon.storage import CheckpointStore

pytestmark = pytest.mark.slow

TOTAL = 8
STEP_S = 5.0  # the pause half-way through each optimizer update: a long step (a loaded
# machine must still save and exit well inside the rest of it)


def job_config(tmp: Path, checkpointing: dict[str, Any], step_s: float, **more: Any) -> dict:
    return {
        "checkpointing": checkpointing,
        "run": RUN,
        "total_steps": TOTAL,
        "step_s": step_s,
        "losses": str(tmp / "losses"),
        **more,
    }


def losses(tmp: Path) -> list[list[str]]:
    return [(tmp / f"losses.{rank}").read_text().splitlines() for rank in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[list[str]]:
    """An uninterrupted run's losses, per rank (the pause changes no number: none here)."""
    tmp = tmp_path_factory.mktemp("reference")
    checkpointing = {"save_dir": str(tmp / "ckpt"), "period_steps": "last_step"}
    for code, _, err in start(job_config(tmp, checkpointing, 0.0)).finish():
        assert code == 0, err[-4000:]
    shown = losses(tmp)
    assert all(len(lines) == TOTAL for lines in shown)
    return shown


def preempt_now(
    tmp: Path,
    place: dict[str, Any],
    *,
    seed: int,
    again: bool = False,
    ballast_mb: int = 0,
    target: int | None = None,
) -> tuple[int, Any, list[tuple[int, str, str]]]:
    """Start the job, wait for a random step to end, SIGTERM one rank (``target``, or a random
    one) at a random moment inside the next step (``again``: once more as soon as it said so);
    check that every rank exited 143 without finishing that step, after one emergency save of
    the step before."""
    chance = random.Random(seed)
    boundary, drawn = chance.randint(1, 2), chance.randint(0, 1)
    target = drawn if target is None else target
    delay = chance.uniform(0.2, 0.4) * STEP_S
    checkpointing = {
        **place,
        "period_steps": 5,
        "num_to_keep": 3,
        "emergency_save": {"signals": ["SIGTERM"], "grace_s": 60, "when": "now"},
    }
    # the steps up to the boundary are quick: only the step the signal lands in is long
    config = job_config(tmp, checkpointing, STEP_S, ballast_mb=ballast_mb, pause_from=boundary + 1)
    job = start(config)
    job.wait_for(0, f"STEP {boundary}")
    time.sleep(delay)
    job.signal([target])
    if again:
        job.wait_for(target, "zephon: SIGTERM: emergency save now", err=True)
        job.signal([target])
    results = job.finish()
    for rank, (code, _, err) in enumerate(results):
        assert code == 143, f"rank {rank} exited {code} (seed {seed}):\n{err[-4000:]}"
    lines = [m for m in map(EMERGENCY_LINE.search, results[0][2].splitlines()) if m]
    assert len(lines) == 1, results[0][2][-4000:]
    line = lines[0]
    assert (line["signal"], int(line["step"])) == ("SIGTERM", boundary), line.group(0)
    # the order of events: the step the signal came in never ended on any rank (its loss is
    # written before its boundary), so the save committed and the job ended inside it
    for rank, lines_of_rank in enumerate(losses(tmp)):
        assert lines_of_rank[-1].split()[0] == str(boundary), (seed, rank, lines_of_rank)
    return boundary, line, results


def resume_and_compare(
    tmp: Path, place: dict[str, Any], step: int, reference: list[list[str]], ballast_mb: int = 0
) -> None:
    """A new start (short steps, no signal) resumes after ``step`` and runs to the end; the
    losses equal the uninterrupted run's."""
    checkpointing = {**place, "period_steps": 5, "num_to_keep": 3}
    job = start(job_config(tmp, checkpointing, 0.0, ballast_mb=ballast_mb))
    assert job.wait_for(0, "RESUMED") == f"RESUMED {step + 1}\n"
    for code, _, err in job.finish():
        assert code == 0, err[-4000:]
    assert losses(tmp) == reference


@pytest.mark.parametrize("seed", [11, 12])  # the signal lands 20-40 % into the step
def test_sigterm_to_one_rank_inside_a_long_step_saves_the_last_boundary_at_once(
    seed, tmp_path, reference
):
    place = local_place(tmp_path)
    step, line, _ = preempt_now(tmp_path, place, seed=seed)
    assert line["url"] == f"{tmp_path}/ckpt/{RUN}/save-{step}"
    check_catalog(place, step)
    resume_and_compare(tmp_path, place, step, reference)


def test_a_second_sigterm_during_the_save_is_ignored_and_tears_nothing(tmp_path, reference):
    # 128 MiB of ballast per rank: the save takes a while, the second signal lands inside it
    place = local_place(tmp_path)
    step, _, results = preempt_now(tmp_path, place, seed=14, again=True, ballast_mb=128, target=0)
    err = results[0][2]
    ignored = err.index("zephon: SIGTERM again: ignored while the emergency save completes")
    assert ignored < err.index(f"emergency save of step {step} committed")  # during the save
    store = CheckpointStore(str(tmp_path / "ckpt"))
    try:
        report = store.run(RUN).verify(step, deep=True)
        assert report.ok, report
    finally:
        store.close()
    check_catalog(place, step)
    resume_and_compare(tmp_path, place, step, reference, ballast_mb=128)


def test_on_s3_through_the_local_tier_the_save_commits_locally_then_uploads(
    tmp_path, reference, s3_place
):
    """The fastest tier: the save commits in local_dir at once, then the watchers wait for the
    upload to save_dir within grace_s before the processes end."""
    place = {**s3_place, "local_dir": str(tmp_path / "local")}
    step, line, _ = preempt_now(tmp_path, place, seed=15)
    assert line["uploaded"] and line["rest"] == ""
    assert line["url"] == f"{s3_place['save_dir']}/{RUN}/save-{step}"
    check_catalog(s3_place, step)
    resume_and_compare(tmp_path, place, step, reference)
