"""``zephon demo``: train, get preempted by a real SIGKILL, resume, and show that the resumed
run's losses equal an uninterrupted run's, bit for bit."""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass, replace

__all__ = ["DemoResult", "run_demo"]


@dataclass
class DemoResult:
    work_dir: str
    save_dir: str
    catalog_url: str
    killed_after: int
    resumed_from: int | None
    compared: dict[int, tuple[float, float]]
    seconds: float

    @property
    def identical(self) -> bool:
        return bool(self.compared) and all(a == b for a, b in self.compared.values())


def run_demo(
    *,
    work_dir: str | None = None,
    save_dir: str | None = None,
    catalog_url: str | None = None,
    storage_options: dict | None = None,
    ranks: int = 2,
    steps: int = 24,
    kill_after: int = 14,
    say=print,
) -> DemoResult:
    from zephon.demo.job import JobSpec
    from zephon.demo.launch import Ranks, read_losses

    started = time.monotonic()
    work_dir = work_dir or tempfile.mkdtemp(prefix="zephon-demo-")
    os.makedirs(work_dir, exist_ok=True)
    save_dir = save_dir or os.path.join(work_dir, "checkpoints")
    catalog_url = catalog_url or f"sqlite:///{os.path.join(work_dir, 'catalog.db')}"
    suffix = uuid.uuid4().hex[:6]
    spec = JobSpec(
        save_dir=save_dir,
        out_dir=work_dir,
        run=f"demo-{suffix}",
        total_steps=steps,
        period_steps=4,
        num_to_keep=2,
        catalog_url=catalog_url,
        storage_options=storage_options or {},
    )
    say(f"work dir {work_dir}; checkpoints in {save_dir}; catalog {catalog_url}")

    say(f"1/4 uninterrupted reference run: {ranks} ranks, {steps} steps")
    reference = replace(spec, tag="reference", run=f"demo-{suffix}-reference")
    Ranks(reference, ranks).wait()

    say(f"2/4 the same job, preempted: SIGKILL of every rank once step {kill_after} is done")
    killed = Ranks(replace(spec, tag="preempted", step_sleep_s=0.05), ranks)
    last = killed.kill_after_step(kill_after)
    say(f"    killed after step {last}")

    say("3/4 resume: the latest complete checkpoint comes from the catalog")
    summary = Ranks(replace(spec, tag="resumed"), ranks).wait()
    say(f"    resumed from save-{summary['resumed_from']}, ran to step {summary['last_step']}")

    say("4/4 run it once more: it is finished")
    again = Ranks(replace(spec, tag="again"), ranks).wait()
    if again.get("finished"):
        say("    Training is already complete, nothing to do")

    ref = read_losses(os.path.join(work_dir, "reference-losses-r0.jsonl"))
    got = read_losses(os.path.join(work_dir, "resumed-losses-r0.jsonl"))
    compared = {step: (ref[step], got[step]) for step in sorted(got)}
    return DemoResult(
        work_dir,
        save_dir,
        catalog_url,
        last,
        summary["resumed_from"],
        compared,
        time.monotonic() - started,
    )
