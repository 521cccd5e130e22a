"""Gloo rank processes for the tests: one launcher for the test side, one set-up for the ranks.

A multi-process test runs a worker module as ``world`` processes, ``python -m <module> RANK WORLD
PORT``, hands every rank the same configuration (JSON in ``$ZEPHON_RANK_CONFIG``), and asserts
on the one line ``RESULT <json>`` each rank prints::

    ranks = launch("tests.zephon.dcp.worker", 2, store_config(backend))   # the test

    def scenario(rank: int, world: int, config: dict) -> dict:            # the worker
        ...
        return {"what": "it saw"}

    if __name__ == "__main__":
        serve(scenario)

``serve`` joins the gloo process group on 127.0.0.1 (one CPU thread, warnings off, as every rank
of the suite), runs the scenario and prints its record, with the traceback as ``crash`` if it
raised; ``launch`` fails the test on a crash, on a rank that printed no record, or on a rank
that exited with an error. The launcher needs no torch; the ranks import it when they join.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable, Collection
from functools import partial
from typing import Any

from tests import servers, zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_ENV = "ZEPHON_RANK_CONFIG"
RESULT = "RESULT "

__all__ = [
    "CONFIG_ENV",
    "ROOT",
    "demo_ranks",
    "launch",
    "rank_config",
    "report",
    "serve",
    "spawn",
    "store_config",
]


# -- the test side --------------------------------------------------------------------------


def store_config(backend: Any) -> dict[str, Any]:
    """The part of a rank's configuration that names the storage: a ``tests.conftest.Backend``'s
    ``url`` and ``storage_options``."""
    return {"url": backend.url, "storage_options": backend.storage_options}


def result_of(stdout: str) -> dict[str, Any] | None:
    """The record of the last ``RESULT <json>`` line a rank printed, or None."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    return json.loads(lines[-1][len(RESULT) :]) if lines else None


def spawn(module: str, world: int, config: dict[str, Any]) -> list[zygote.Forked]:
    """Start ``python -m module RANK WORLD PORT`` as ``world`` processes from the repository
    root, ``config`` in ``$ZEPHON_RANK_CONFIG``, stdout and stderr piped as text; forked from
    the zygote (tests/zygote.py), which imported torch once for all of them."""
    port = servers.free_port()
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, CONFIG_ENV: json.dumps(config)}
    return [
        zygote.popen(
            ["-m", module, str(rank), str(world), str(port)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]


def launch(
    module: str,
    world: int,
    config: dict[str, Any],
    *,
    timeout: float = 300,
    allow_killed: Collection[int] = frozenset(),
) -> list[dict[str, Any]]:
    """Run ``python -m module RANK WORLD PORT`` as ``world`` processes from the repository root,
    ``config`` in ``$ZEPHON_RANK_CONFIG``, and return every surviving rank's record in rank
    order. The ranks in ``allow_killed`` must die of SIGKILL instead (their records are left
    out); ``timeout`` is how long each rank may take once the ones before it have ended."""
    procs = spawn(module, world, config)
    ranks = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            if rank in allow_killed:
                assert proc.returncode == -9, f"rank {rank} exited {proc.returncode}: {err[-2000:]}"
                continue
            record = result_of(out)
            assert proc.returncode == 0 and record is not None, (
                f"rank {rank} exited {proc.returncode}:\n{err[-4000:]}"
            )
            ranks.append(record)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for record in ranks:
        assert "crash" not in record, record["crash"]
    return ranks


def demo_ranks() -> Callable[..., Any]:
    """The demo's ``zephon.demo.launch.Ranks`` with each rank forked from the zygote
    (tests/zygote.py), which imported torch once, instead of started afresh: called as
    ``Ranks(spec, world)``. The class is taken now, so a test may also put the result in its
    place, ``monkeypatch.setattr(launch, "Ranks", demo_ranks())``, for ``zephon demo`` itself
    to start its ranks so. Imported here, not at the top: the ranks import this module."""
    from zephon.demo.launch import Ranks

    return partial(Ranks, popen=zygote.popen_like())


# -- the rank side --------------------------------------------------------------------------


def rank_config() -> dict[str, Any]:
    """This rank's configuration, as the test gave it to ``launch``."""
    return json.loads(os.environ[CONFIG_ENV])


def report(record: dict[str, Any]) -> None:
    """Print ``RESULT <json>``: what this rank tells the test (anything not JSON as its str)."""
    print(RESULT + json.dumps(record, default=str), flush=True)


def join_group(rank: int, world: int, port: int, timeout: float = 90) -> None:
    """Join the gloo process group of ``world`` ranks whose rank 0 listens on 127.0.0.1:port."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=dt.timedelta(seconds=timeout)
    )


def serve(
    scenario: Callable[[int, int, dict[str, Any]], dict[str, Any]],
    *,
    timeout: float = 90,
    teardown: bool = True,
) -> None:
    """Be the rank ``sys.argv`` names: join the group, run ``scenario(rank, world, config)`` and
    report ``{"rank": rank, **its record}`` (``crash``: the traceback, if it raised). Then leave
    the group, or with ``teardown=False`` exit at once: a group that lost a rank to SIGKILL
    cannot be torn down. ``timeout`` bounds every collective, in seconds."""
    import torch.distributed as dist

    rank, world, port = (int(arg) for arg in sys.argv[1:4])
    config = rank_config()
    join_group(rank, world, port, timeout)
    out: dict[str, Any] = {"rank": rank}
    try:
        out.update(scenario(rank, world, config))
    except BaseException:
        out["crash"] = traceback.format_exc()
    report(out)
    if not teardown:
        os._exit(0)
    dist.destroy_process_group()
