"""Starting the save-on-preemption tests' training job (``tests.zephon.emergency.train``) as
real rank processes, signalling them like a scheduler, and reading what they printed.

Unlike ``tests.ranks.launch``, a start here is watched while it runs: its output is read line
by line on threads, so a test can wait for a step (or a save) to be under way, then send
SIGTERM to every rank or to one, and check the exit codes (143: preempted) afterwards.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.ranks import spawn

__all__ = ["EMERGENCY_LINE", "Start", "start"]

MODULE = "tests.zephon.emergency.train"
#: the line rank 0 logs after an emergency save
EMERGENCY_LINE = re.compile(
    r"zephon: (?P<signal>SIG\w+): emergency save of step (?P<step>\d+) committed in "
    r"(?P<seconds>[\d.]+) s(?P<uploaded> and uploaded in [\d.]+ s)? \((?P<url>[^)]+)\)"
    r"(?P<rest>.*); exiting"
)


@dataclass
class Rank:
    proc: subprocess.Popen
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    #: set once stdout, then stderr, were read to their end
    read: list[threading.Event] = field(default_factory=list)


@dataclass
class Start:
    """One start of the job: its rank processes and what they printed so far."""

    ranks: list[Rank]

    def wait_for(self, rank: int, prefix: str, timeout: float = 240, *, err: bool = False) -> str:
        """Wait until ``rank`` printed a line starting with ``prefix`` (``err``: on stderr);
        that line."""
        who = self.ranks[rank]
        deadline = time.monotonic() + timeout
        with who.changed:
            while True:
                for line in who.err if err else who.out:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or all(done.is_set() for done in who.read):
                    raise AssertionError(
                        f"rank {rank} never printed {prefix!r}; stderr:\n"
                        + "".join(who.err)[-4000:]
                    )
                who.changed.wait(min(left, 0.5))

    def signal(self, ranks: Iterable[int], number: int = signal.SIGTERM) -> None:
        for rank in ranks:
            self.ranks[rank].proc.send_signal(number)

    def finish(self, timeout: float = 300) -> list[tuple[int, str, str]]:
        """Wait for every rank: (exit code, stdout, stderr) each; kill what is left after
        ``timeout``."""
        results = []
        try:
            for who in self.ranks:
                code = who.proc.wait(timeout=timeout)
                for done in who.read:
                    done.wait(timeout)
                results.append((code, "".join(who.out), "".join(who.err)))
        finally:
            for who in self.ranks:
                if who.proc.poll() is None:
                    who.proc.kill()
                    who.proc.wait()
        return results


def _read(who: Rank, stream, into: list[str], done: threading.Event) -> None:
    for line in stream:
        with who.changed:
            into.append(line)
            who.changed.notify_all()
    done.set()


def start(config: dict[str, Any], world: int = 2) -> Start:
    """Run the training job as ``world`` ranks with ``config``."""
    ranks = []
    for proc in spawn(MODULE, world, config):
        who = Rank(proc)
        for stream, into in ((proc.stdout, who.out), (proc.stderr, who.err)):
            done = threading.Event()
            who.read.append(done)
            threading.Thread(target=_read, args=(who, stream, into, done), daemon=True).start()
        ranks.append(who)
    return Start(ranks)
