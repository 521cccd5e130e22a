"""Simulated nodes on one machine: one ``torchrun`` agent per node, each with a private working
directory, ``HOME`` and ``TMPDIR``, sharing nothing but what the job is told (S3, PostgreSQL).

A node is killed the way a machine dies: SIGKILL to every process it runs at once. torchrun
starts each worker in a session of its own, so killing the agent's process group alone would
leave the workers running (orphans a dead machine would not have): ``Node.kill`` sends SIGKILL
to the process group of the agent and to that of each of its descendants.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests import zygote
from zephon.demo.elastic_job import ElasticSpec, spec_json
from zephon.demo.launch import free_port

__all__ = ["Cluster", "Launch", "Node", "descendants", "read_json", "read_steps"]

#: rank 0's outputs, copied out of its node before the node's directory is deleted
OUTPUTS = ("start.json", "steps.jsonl", "final.pt", "held.json")


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, from /proc (parents before children); a process
    the tests' zygote forked at another's request counts as that one's child
    (tests/zygote.py: torchrun's workers under tests/torchrun.py)."""
    children: dict[int, list[int]] = {}
    for child, parent in zygote.requesters().items():
        children.setdefault(parent, []).append(child)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:  # gone meanwhile
            continue
        # the command name in parentheses may hold spaces: fields start after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


class Node:
    """One node: a torchrun agent in ``root/work`` with ``HOME=root/home``, ``TMPDIR=root/tmp``.

    With ``torchrun=False`` the node runs the job as one plain process (no torch.distributed).
    """

    def __init__(
        self,
        root: Path,
        spec: ElasticSpec,
        *,
        nnodes: int,
        node_rank: int,
        nproc: int,
        port: int,
        torchrun: bool = True,
    ) -> None:
        self.root = root
        self.work, home, tmp = root / "work", root / "home", root / "tmp"
        for path in (self.work, home, tmp):
            path.mkdir(parents=True)
        # Nothing of the test's own environment: a node knows only the job spec.
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "TMPDIR": str(tmp),
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        job = ["-m", "zephon.demo.elastic_job", spec_json(spec)]
        launcher = [
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={spec.run}",
            "--local-addr=127.0.0.1",
            "--max-restarts=0",
            "--monitor-interval=0.2",
        ]
        argv = [*(launcher if torchrun else []), *job]
        self.log = root.parent / f"{root.name}.log"  # outside the node: logs are not state
        with open(self.log, "ab") as log:
            # forked from an interpreter that imported torch (tests/zygote.py): the agent, or
            # the job itself without torchrun
            self.proc = zygote.popen(
                argv,
                cwd=self.work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self, name: str) -> Path:
        return self.work / name

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL every process of the node at once, then reap the agent."""
        groups = []
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                groups.append(os.getpgid(pid))
        for group in dict.fromkeys(groups):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.proc.wait()

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Launch:
    """The nodes of one start of the job, and what came of it."""

    nodes: list[Node]
    #: the exit code of each node's agent (None: it had to be killed)
    exit_codes: list[int | None]


class Cluster:
    """``nnodes`` nodes of ``nproc`` processes under ``base/node<i>``; every launch starts on
    freshly created node directories, and ``wipe`` deletes them after copying rank 0's outputs
    to ``base/results/<tag>``."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.started: list[Node] = []

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        """Kill whatever still runs (a failed or timed-out test): no node outlives its test."""
        for node in self.started:
            if node.alive():
                node.kill()

    def start(
        self, spec: ElasticSpec, *, nnodes: int, nproc: int, torchrun: bool = True
    ) -> list[Node]:
        assert torchrun or (nnodes, nproc) == (1, 1), "a plain process is one node of one rank"
        port = free_port()
        roots = [self.base / f"node{i}" for i in range(nnodes)]
        for root in roots:
            assert not root.exists(), f"{root} was not deleted before this launch"
        nodes = [
            Node(root, spec, nnodes=nnodes, node_rank=i, nproc=nproc, port=port, torchrun=torchrun)
            for i, root in enumerate(roots)
        ]
        self.started += nodes
        return nodes

    def run(
        self,
        spec: ElasticSpec,
        tag: str,
        *,
        nnodes: int,
        nproc: int,
        torchrun: bool = True,
        timeout: float = 180,
    ) -> Path:
        """Start, wait for every node to succeed, collect and wipe; returns the results."""
        nodes = self.start(spec, nnodes=nnodes, nproc=nproc, torchrun=torchrun)
        deadline = time.monotonic() + timeout
        for node in nodes:
            try:
                code = node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                for other in nodes:
                    other.kill()
                logs = "\n".join(f"--- {n.root.name}:\n{n.tail()}" for n in nodes)
                raise AssertionError(f"{tag}: {node.root.name} ended with {code}\n{logs}")
        return self.wipe(nodes, tag)

    def run_and_kill(
        self, spec: ElasticSpec, tag: str, *, nnodes: int, nproc: int, timeout: float = 180
    ) -> tuple[Path, Launch]:
        """Start with ``spec.hold_after_step``; once rank 0 holds there, SIGKILL its node; give
        the others a few seconds to fail on their own (they wait on rank 0), then kill them."""
        assert spec.hold_after_step is not None
        nodes = self.start(spec, nnodes=nnodes, nproc=nproc)
        deadline = time.monotonic() + timeout
        victim = None
        while victim is None:
            victim = next((n for n in nodes if n.output("held.json").exists()), None)
            stuck = not all(n.alive() for n in nodes) or time.monotonic() > deadline
            if victim is None and stuck:
                for node in nodes:
                    node.kill()
                logs = "\n".join(f"--- {n.root.name}:\n{n.tail()}" for n in nodes)
                raise AssertionError(f"{tag}: no node reached the hold\n{logs}")
            time.sleep(0.02)
        victim.kill()
        codes: list[int | None] = []
        for node in nodes:
            if node is victim:
                codes.append(None)
                continue
            try:
                codes.append(node.proc.wait(30))
            except subprocess.TimeoutExpired:
                node.kill()
                codes.append(None)
        return self.wipe(nodes, tag), Launch(nodes, codes)

    def wipe(self, nodes: list[Node], tag: str) -> Path:
        """Copy rank 0's outputs out of whichever node holds them, then delete every node's
        directory: only S3 and PostgreSQL carry anything to the next launch."""
        results = self.base / "results" / tag
        results.mkdir(parents=True)
        for node in nodes:
            for name in OUTPUTS:
                if node.output(name).exists():
                    shutil.copy(node.output(name), results / name)
            shutil.rmtree(node.root)
        return results


def read_steps(results: Path) -> dict[int, dict[str, Any]]:
    """step -> {"loss", "lanes"} from rank 0's steps.jsonl (a line cut by SIGKILL is ignored)."""
    steps: dict[int, dict[str, Any]] = {}
    text = (results / "steps.jsonl").read_text() if (results / "steps.jsonl").exists() else ""
    for line in text.splitlines(keepends=True):
        if line.endswith("\n"):
            record = json.loads(line)
            steps[record.pop("step")] = record
    return steps


def read_json(results: Path, name: str) -> dict[str, Any]:
    return json.loads((results / name).read_text())
