"""Starting, waiting for and preempting the ranks of ``zephon.demo.job`` as real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from zephon.demo.job import JobSpec
from zephon.errors import ZephonError

__all__ = ["Ranks", "free_port", "read_losses"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Ranks:
    """``world`` processes running one job spec, one rank each (gloo on 127.0.0.1)."""

    def __init__(
        self,
        spec: JobSpec,
        world: int,
        *,
        env: dict[str, str] | None = None,
        popen: Callable[..., Any] = subprocess.Popen,
    ) -> None:
        """``popen``: what starts each rank, with ``subprocess.Popen``'s arguments (the tests
        fork ranks from an interpreter that imported torch once)."""
        self.spec = spec
        port = str(free_port())
        base = {
            **os.environ,
            **(env or {}),
            "WORLD_SIZE": str(world),
            "MASTER_PORT": port,
            "PYTHONWARNINGS": "ignore",
        }
        argv = [sys.executable, "-m", "zephon.demo.job", json.dumps(asdict(spec))]
        self.procs = [
            popen(
                argv,
                env={**base, "RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for rank in range(world)
        ]

    def wait(self, timeout: float = 300) -> dict[str, Any]:
        """Wait for every rank; raise with their stderr if one failed. Rank 0's summary."""
        outputs = [proc.communicate(timeout=timeout) for proc in self.procs]
        failed = [
            (r, p.returncode, err)
            for r, (p, (_, err)) in enumerate(zip(self.procs, outputs, strict=True))
            if p.returncode != 0
        ]
        if failed:
            rank, code, err = failed[0]
            raise ZephonError(
                f"demo rank {rank} exited with {code}; the end of its stderr: {_tail(err)}"
            )
        return json.loads(outputs[0][0].strip().splitlines()[-1])

    def kill_after_step(self, step: int, timeout: float = 300) -> int:
        """SIGKILL every rank once rank 0 has logged ``step``; returns the last step logged."""
        log = "losses" if self.spec.kind == "train" else "outputs"
        path = os.path.join(self.spec.out_dir, f"{self.spec.tag}-{log}-r0.jsonl")
        deadline = time.monotonic() + timeout
        while True:
            logged = read_losses(path)
            if logged and max(logged) >= step:
                break
            if any(p.poll() is not None for p in self.procs):
                self.kill()
                raise ZephonError(
                    f"a demo rank exited before step {step}; the end of their stderr: "
                    + " || ".join(_tail(p.communicate()[1]) for p in self.procs)
                )
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"step {step} not reached in {timeout} s")
            time.sleep(0.01)
        self.kill()
        return max(read_losses(path))

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.communicate()


def read_losses(path: str) -> dict[int, Any]:
    """step -> loss (or, for an outputs file, the ids) from a job's log; the last line for a
    step wins."""
    out: dict[int, float] = {}
    if not os.path.exists(path):
        return out
    with open(path) as handle:
        for line in handle:
            if line.endswith("\n"):
                record = json.loads(line)
                out[record["step"]] = record.get("loss", record.get("ids"))
    return out


def _tail(err: str, lines: int = 20) -> str:
    """The last ``lines`` lines of a rank's stderr on one line (an error message is one)."""
    return " | ".join(line.strip() for line in err.strip().splitlines()[-lines:])[-4000:]
