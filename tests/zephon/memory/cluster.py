"""Simulated nodes for the memory tier's tests: each a ``torchrun --nnodes N --node-rank i``
agent on this machine whose host memory is a directory of its own; a node is lost by deleting
its directory.

``crash_then_resume`` runs the job of ``memory_job.py`` until a crash after a save (every
process ends at once; the nodes' memory stays unless the case deletes it), then starts it
again, and checks that every loss of both runs equals the uninterrupted run's
(``memory_job.reference_losses``), bit for bit. To prove a resume read memory, save_dir's copy
of the step can lose its tensors first (a load from there would fail).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests import servers, zygote
from tests.ranks import ROOT
from tests.zephon.memory.memory_job import LOCAL_ENV, MEMORY_ENV, reference_losses
from tests.zephon.multinode.nodes import descendants

STEPS = 6
PERIOD = 2
CRASH = 4


def launch(
    job: dict,
    memory_dirs: list[Path],
    nproc: int,
    expect: int,
    timeout: float = 240,
    local_dirs: list[Path] | None = None,
):
    """One start of the job: a torchrun agent per node (static rendezvous on 127.0.0.1);
    ``local_dirs``: each node's local disk, behind its memory."""
    port = servers.free_port()
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    procs = []
    for node, memory in enumerate(memory_dirs):
        local = {LOCAL_ENV: str(local_dirs[node])} if local_dirs is not None else {}
        env = {
            **os.environ,
            **local,
            "PYTHONPATH": path,
            MEMORY_ENV: str(memory),
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        # torchrun, forked from the zygote, forking its workers from it too (tests/torchrun.py)
        argv = [
            "-m",
            "tests.torchrun",
            zygote.address_of(env),
            f"--nnodes={len(memory_dirs)}",
            f"--node-rank={node}",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            "-m",
            "tests.zephon.memory.memory_job",
            json.dumps(job),
        ]
        procs.append(
            zygote.popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    logs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = [pid for other in procs for pid in descendants(other.pid)]
            for pid in hung:  # the workers print where they are (faulthandler)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
            for pid in hung[::-1]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            tails = [other.communicate()[0].decode(errors="replace")[-200000:] for other in procs]
            message = f"the job did not end in {timeout} s:\n" + "\n".join(tails)
            raise AssertionError(message) from None
        logs.append(out.decode(errors="replace"))
    codes = [proc.returncode for proc in procs]
    text = "\n".join(
        f"--- node {i} (exit {c}):\n{log[-4000:]}"
        for i, (c, log) in enumerate(zip(codes, logs, strict=True))
    )
    if expect == 0:
        assert codes == [0] * len(procs), text
    else:
        assert all(code != 0 for code in codes), text
    return text


def losses(out: Path) -> dict[tuple[int, int], float]:
    found = {}
    for path in out.glob("losses-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found[(row["step"], row["rank"])] = row["loss"]
    return found


def spec(tmp_path: Path, name: str, **extra) -> dict:
    out = tmp_path / f"out-{name}"
    out.mkdir(parents=True)
    return {
        "save_dir": str(tmp_path / "save_dir"),
        "run": "mem",
        "steps": STEPS,
        "period": PERIOD,
        "out": str(out),
        **extra,
    }


def strip_tensors(save_dir: Path, step: int, run: str = "mem") -> None:
    """save_dir's copy of ``step`` keeps its marker but loses its tensor files."""
    removed = 0
    for path in (save_dir / run / f"save-{step}").rglob("*.distcp"):
        path.unlink()
        removed += 1
    assert removed


def crash_then_resume(
    tmp_path,
    memory_dirs,
    *,
    lose=(),
    nproc=1,
    strip=True,
    unupload=False,
    local_dirs=None,
    **extra,
):
    """``strip``: save_dir's copy of the crash step loses its tensors; ``unupload``: it is
    gone altogether (its upload never happened); ``local_dirs``: each node's local disk,
    kept whatever memory loses."""
    reference = reference_losses(len(memory_dirs) * nproc, STEPS)
    first = spec(tmp_path, "first", crash_after=CRASH, **extra)
    launch(first, memory_dirs, nproc, expect=17, local_dirs=local_dirs)
    check_losses(Path(first["out"]), reference)
    assert max(step for step, _ in losses(Path(first["out"]))) == CRASH  # it died there
    for node in lose:
        shutil.rmtree(memory_dirs[node])
    if unupload:
        shutil.rmtree(tmp_path / "save_dir" / "mem" / f"save-{CRASH}")
    elif strip:
        strip_tensors(tmp_path / "save_dir", CRASH)
    second = spec(tmp_path, "second", **extra)
    log = launch(second, memory_dirs, nproc, expect=0, local_dirs=local_dirs)
    check_losses(Path(second["out"]), reference)
    return start_of(second), log


def check_losses(out: Path, reference: dict[tuple[int, int], float]) -> None:
    """Every loss a run wrote equals the uninterrupted run's."""
    found = losses(out)
    assert found
    for key, loss in found.items():
        assert loss == reference[key], (key, loss, reference[key])


def start_of(job: dict) -> dict:
    """Where the run started: the step resumed from and the URL it was read from."""
    return json.loads((Path(job["out"]) / "start.json").read_text())
