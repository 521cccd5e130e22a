"""Resuming from the memory tier with real processes (docs/tiers.md, "Resuming from memory"):
simulated nodes on one machine, each a ``torchrun --nnodes N --node-rank i`` agent whose host
memory is a directory of its own; a node is lost by deleting its directory.

Every case runs the job of ``memory_job.py`` until a crash after a save (every process ends at
once; the nodes' memory stays unless a case deletes it), then starts it again, and checks
where the resume read the checkpoint from and that from there on every loss equals the
uninterrupted run's, bit for bit. To prove the resume read memory, save_dir's copy of the step
loses its tensors first (a load from there would fail).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import servers
from tests.ranks import ROOT
from tests.zephon.memory.memory_job import MEMORY_ENV
from tests.zephon.multinode.nodes import descendants

pytestmark = pytest.mark.slow

STEPS = 6
PERIOD = 2
CRASH = 4


def _launch(spec: dict, memory_dirs: list[Path], nproc: int, expect: int, timeout: float = 240):
    """One start of the job: a torchrun agent per node (static rendezvous on 127.0.0.1)."""
    port = servers.free_port()
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    procs = []
    for node, memory in enumerate(memory_dirs):
        env = {
            **os.environ,
            "PYTHONPATH": path,
            MEMORY_ENV: str(memory),
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={len(memory_dirs)}",
            f"--node-rank={node}",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            "-m",
            "tests.zephon.memory.memory_job",
            json.dumps(spec),
        ]
        procs.append(
            subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
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


def _losses(out: Path) -> dict[tuple[int, int], float]:
    found = {}
    for path in out.glob("losses-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found[(row["step"], row["rank"])] = row["loss"]
    return found


def _spec(tmp_path: Path, name: str, **extra) -> dict:
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


def _strip_tensors(save_dir: Path, step: int) -> None:
    """save_dir's copy of ``step`` keeps its marker but loses its tensor files."""
    removed = 0
    for path in (save_dir / "mem" / f"save-{step}").rglob("*.distcp"):
        path.unlink()
        removed += 1
    assert removed


def _reference(tmp: Path, nodes: int, nproc: int) -> dict[tuple[int, int], float]:
    """The uninterrupted run's losses (every step, every rank)."""
    spec = _spec(tmp, "ref", memory_tier=False)
    _launch(spec, [tmp / f"m{i}" for i in range(nodes)], nproc, expect=0)
    return _losses(Path(spec["out"]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[tuple[int, int], float]:
    """On 2 nodes x 1 rank."""
    return _reference(tmp_path_factory.mktemp("reference"), 2, 1)


def _crash_then_resume(
    tmp_path, reference, memory_dirs, *, lose=(), nproc=1, strip=True, unupload=False, **extra
):
    """``strip``: save_dir's copy of the crash step loses its tensors; ``unupload``: it is
    gone altogether (its upload never happened)."""
    first = _spec(tmp_path, "first", crash_after=CRASH, **extra)
    _launch(first, memory_dirs, nproc, expect=17)
    for node in lose:
        shutil.rmtree(memory_dirs[node])
    if unupload:
        shutil.rmtree(tmp_path / "save_dir" / "mem" / f"save-{CRASH}")
    elif strip:
        _strip_tensors(tmp_path / "save_dir", CRASH)
    second = _spec(tmp_path, "second", **extra)
    log = _launch(second, memory_dirs, nproc, expect=0)
    start = json.loads((Path(second["out"]) / "start.json").read_text())
    losses = _losses(Path(second["out"]))
    assert losses, log
    for key, loss in losses.items():
        assert loss == reference[key], (key, loss, reference[key])
    return start, log


def test_a_job_restarting_with_every_node_alive_resumes_from_its_own_memory(tmp_path, reference):
    start, log = _crash_then_resume(tmp_path, reference, [tmp_path / "m0", tmp_path / "m1"])
    assert start["step"] == CRASH and "/.resume/" in start["url"], log
    assert "assembled from own memory" in log, log


def test_a_lost_node_is_replaced_from_its_peer_copy(tmp_path, reference):
    start, log = _crash_then_resume(
        tmp_path, reference, [tmp_path / "m0", tmp_path / "m1"], lose=[1]
    )
    assert start["step"] == CRASH and "/.resume/" in start["url"], log
    assert "MiB from peers" in log, log


def test_two_adjacent_lost_nodes_fall_back_to_save_dir(tmp_path, reference):
    start, log = _crash_then_resume(
        tmp_path, reference, [tmp_path / "m0", tmp_path / "m1"], lose=[0, 1], strip=False
    )
    assert start["step"] == CRASH and "/.resume/" not in start["url"], log
    assert start["url"].startswith(str(tmp_path / "save_dir")), start


def test_on_three_nodes_a_lost_node_comes_from_the_next_and_two_adjacent_ones_from_save_dir(
    tmp_path,
):
    """The ring: node 1's part is copied to node 2 only. Losing node 1 alone, its part comes
    from node 2; losing nodes 1 and 2, nobody holds it and save_dir is loaded."""
    from zephon.catalog import Catalog

    reference = _reference(tmp_path / "ref", 3, 1)
    alone = tmp_path / "alone"
    catalog_url = f"sqlite:///{alone}/catalog.db"
    start, log = _crash_then_resume(
        alone, reference, [alone / f"m{i}" for i in range(3)], lose=[1], catalog_url=catalog_url
    )
    assert start["step"] == CRASH and "/.resume/" in start["url"], log
    with Catalog(catalog_url) as catalog:  # one row per node; step 2 left memory at step 4
        rows = catalog.replicas("mem", step=2, tier="memory")
    assert sorted(row.host.rsplit("/", 1)[-1] for row in rows) == ["m0", "m1", "m2"]
    assert {row.state for row in rows} == {"deleted"}
    both = tmp_path / "both"
    start, log = _crash_then_resume(
        both, reference, [both / f"m{i}" for i in range(3)], lose=[1, 2], strip=False
    )
    assert start["step"] == CRASH and start["url"].startswith(str(both / "save_dir")), log


def test_two_nodes_of_two_ranks_resume_a_lost_node_and_upload_what_save_dir_missed(tmp_path):
    reference = _reference(tmp_path / "ref", 2, 2)
    start, log = _crash_then_resume(
        tmp_path,
        reference,
        [tmp_path / "m0", tmp_path / "m1"],
        lose=[0],
        nproc=2,
        unupload=True,
    )
    assert start["step"] == CRASH and "MiB from peers" in log, log
    # newer than save_dir's latest: the new attempt uploaded it, from the assembled copy
    from zephon.storage import CheckpointStore

    run = CheckpointStore(str(tmp_path / "save_dir")).run("mem")
    assert CRASH in run.committed_steps() and run.verify(CRASH, deep=True).ok


def test_a_stale_attempts_memory_copy_is_never_loaded(tmp_path, reference):
    """Attempt 1 saves step 4 in memory and dies. Attempt 2, on other nodes, resumes from
    step 2 (save_dir's step 4 is gone) and dies before saving: attempt 1's step 4 is no longer
    in the run's history. Attempt 3, back on the first nodes, finds it complete in memory and
    must not load it."""
    memory = [tmp_path / "m0", tmp_path / "m1"]
    first = _spec(tmp_path, "first", crash_after=CRASH)
    _launch(first, memory, 1, expect=17)
    shutil.rmtree(tmp_path / "save_dir" / "mem" / f"save-{CRASH}")
    second = _spec(tmp_path, "second", die_at=CRASH - 1)
    _launch(second, [tmp_path / "other0", tmp_path / "other1"], 1, expect=18)
    assert json.loads((Path(second["out"]) / "start.json").read_text())["step"] == CRASH - 2
    third = _spec(tmp_path, "third")
    log = _launch(third, memory, 1, expect=0)
    start = json.loads((Path(third["out"]) / "start.json").read_text())
    assert start["step"] == CRASH - 2 and "/.resume/" not in start["url"], log
    for key, loss in _losses(Path(third["out"])).items():
        assert loss == reference[key], key
