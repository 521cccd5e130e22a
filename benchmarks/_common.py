"""Shared helpers for the benchmark scripts: repo on sys.path, timing, and the local servers.

Every benchmark reports ratios against a baseline measured in the same run, because the machine
is shared and absolute numbers drift from run to run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests import servers  # noqa: E402  (needs the repo on sys.path)

__all__ = ["REPO", "servers", "timed", "best_of", "interleaved", "count_s3_requests", "table"]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_of(repeats: int, fn: Callable[[], object], setup: Callable[[], object] = lambda: None):
    """Median and minimum wall time of ``fn`` over ``repeats`` runs, ``setup`` untimed."""
    times = []
    for _ in range(repeats):
        setup()
        times.append(timed(fn))
    return statistics.median(times), min(times)


def interleaved(
    repeats: int,
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    setup: Callable[[], object] = lambda: None,
) -> tuple[float, float, float]:
    """Median baseline time, median candidate time, and the median of the per-repeat ratios
    baseline/candidate, running the two back to back in each repeat so that load changes on a
    shared machine hit both alike."""
    base_times, cand_times, ratios = [], [], []
    for _ in range(repeats):
        setup()
        b = timed(baseline)
        setup()
        c = timed(candidate)
        base_times.append(b)
        cand_times.append(c)
        ratios.append(b / c)
    return statistics.median(base_times), statistics.median(cand_times), statistics.median(ratios)


class count_s3_requests:  # noqa: N801 - used as a context manager, reads like a function
    """Count the HTTP requests an s3fs filesystem sends while the block runs."""

    def __init__(self, fs) -> None:
        self.fs = fs
        self.count = 0
        self.by_operation: dict[str, int] = {}

    def _on_call(self, model, **_):
        self.count += 1
        self.by_operation[model.name] = self.by_operation.get(model.name, 0) + 1

    def __enter__(self):
        self.fs.connect()  # make sure the client exists before hooking it
        self.fs.s3.meta.events.register("before-call.s3", self._on_call)
        return self

    def __exit__(self, *exc):
        self.fs.s3.meta.events.unregister("before-call.s3", self._on_call)


def table(rows: list[tuple], headers: tuple) -> str:
    cells = [tuple(str(c) for c in headers)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_ranks(script: str, world: int, config: dict, what: str) -> dict:
    """Run ``script --worker <rank> <world> <port> <config json>`` as ``world`` processes (a
    rendezvous port for torch.distributed on 127.0.0.1) and return the JSON that rank 0
    prints on a line ``RESULT <json>``. ``what`` names the case if a rank fails."""
    port = servers.free_port()
    env = {**os.environ, "PYTHONPATH": REPO}
    argv = [sys.executable, os.path.abspath(script), "--worker"]
    procs = [
        subprocess.Popen(
            [*argv, str(rank), str(world), str(port), json.dumps(config)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"{what} on {world} process(es): a rank exited with an error")
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])
