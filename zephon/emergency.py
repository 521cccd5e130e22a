"""Save on preemption (docs/manager.md, "Save on preemption"): ``trainer.checkpointing.
emergency_save``.

A scheduler that preempts a job sends it a signal (SIGTERM, usually) and kills it a grace period
later. With ``emergency_save`` configured, the checkpoint manager catches the listed signals and
saves the job at the next step boundary instead of losing everything since the last periodic
save:

1. the handler (installed by the manager in the main thread of each rank, the previous handlers
   restored at ``close``) only notes the signal and when it came: it never saves from inside
   the code it interrupted, so a save never sees half-updated tensors;
2. every ``maybe_save(step, state)`` call runs one tiny all-reduce (MAX) of "signal seen" on the
   manager's own gloo group, so a signal delivered to one rank makes every rank save the same
   step (``EmergencySave.due``);
3. the save is the manager's ordinary save of that step, committed and fenced like any other
   and marked ``"trigger": "emergency"`` in its metadata; then the manager waits for the
   uploads for what is left of ``grace_s``, logs one line and raises ``Preempted`` (a
   ``SystemExit`` with the signal's conventional code, 128 + its number), so ``with manager:``
   closes and the process exits as the signal would have ended it.

A second signal while the job heads for its emergency save is logged and ignored (the save
completes); a third restores the previous handler and delivers the signal again (by default the
process ends at once: the save under way is then not committed, never torn).

With ``when: now`` (steps too long to wait for the next boundary) the save does not wait for
the training loop: ``zephon.emergency_now`` keeps a host copy of the state of the last step
boundary and a thread per rank saves that copy as soon as any rank is signalled, then ends the
process. This module holds what both share: the configuration, the handlers, the trigger and
the save-then-line sequence (``EmergencySave.run``).

This module imports no torch until a distributed agreement is made (``zephon.config`` imports
the configuration part).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zephon.errors import ConfigError, invalid_option

__all__ = ["WHEN", "EmergencySave", "EmergencySaveConfig", "Preempted", "Trigger", "leave"]

log = logging.getLogger("zephon")

#: when the emergency save happens: at the next step boundary (``maybe_save``), or at once, of
#: the state of the last boundary (``zephon.emergency_now``)
WHEN = ("step", "now")
#: signals a process cannot catch
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")
_KEYS = ("signals", "grace_s", "when")
#: the longest grace period accepted: a day
MAX_GRACE_S = 86400.0


def _signal_number(name: str) -> int | None:
    member = getattr(signal.Signals, name, None) if name.startswith("SIG") else None
    return int(member) if isinstance(member, signal.Signals) else None


@dataclass(frozen=True, slots=True)
class EmergencySaveConfig:
    """``trainer.checkpointing.emergency_save``: which signals trigger a save on preemption,
    how long the job may take to save and upload (``grace_s``, counted from the signal), and
    when it saves (``"step"``: at the next ``maybe_save``; ``"now"``: at once, the state as it
    was at the last ``maybe_save``, of which every ``maybe_save`` then keeps a host copy).

    A save never captures the state from inside a step (an optimizer step half done): ``now``
    saves the copy taken at the last boundary, not the live state.
    """

    signals: tuple[str, ...] = ("SIGTERM",)
    grace_s: float = 30.0
    when: str = "step"
    prefix: str = "trainer.checkpointing.emergency_save"

    def __post_init__(self) -> None:
        p = self.prefix
        names = self.signals
        if isinstance(names, str) or not isinstance(names, list | tuple) or not names:
            raise invalid_option(
                f"{p}.signals", names, "use a list of signal names, e.g. [SIGTERM]"
            )
        checked: list[str] = []
        for name in names:
            if isinstance(name, str) and name.upper() in _UNCATCHABLE:
                raise invalid_option(
                    f"{p}.signals", name, "SIGKILL and SIGSTOP cannot be caught; use e.g. SIGTERM"
                )
            if not isinstance(name, str) or _signal_number(name) is None:
                raise invalid_option(
                    f"{p}.signals", name, "use signal names such as SIGTERM, SIGINT or SIGUSR1"
                )
            if name not in checked:
                checked.append(name)
        object.__setattr__(self, "signals", tuple(checked))
        grace = self.grace_s
        if (
            isinstance(grace, bool)
            or not isinstance(grace, int | float)
            or not 0 < grace <= MAX_GRACE_S
        ):
            raise invalid_option(
                f"{p}.grace_s", grace, f"use a number of seconds above 0, at most {MAX_GRACE_S:g}"
            )
        object.__setattr__(self, "grace_s", float(grace))
        if self.when not in WHEN:
            raise invalid_option(
                f"{p}.when", self.when, 'use "step" (the next step boundary) or "now"'
            )

    @classmethod
    def of(cls, value: Any, prefix: str) -> EmergencySaveConfig | None:
        """The config from itself, None (off) or a YAML mapping of its keys; ``ConfigError``
        naming ``prefix`` for anything else."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise invalid_option(
                prefix, value, "use a mapping such as {signals: [SIGTERM], grace_s: 30}"
            )
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ConfigError(
                f"{prefix}.{unknown[0]} is not a known setting; known: {', '.join(_KEYS)}"
            )
        options = dict(value)
        if isinstance(options.get("signals"), list):
            options["signals"] = tuple(options["signals"])
        return cls(**options, prefix=prefix)

    @property
    def numbers(self) -> tuple[int, ...]:
        """The signals' numbers."""
        return tuple(int(_signal_number(name) or 0) for name in self.signals)


class Preempted(SystemExit):
    """The job saved on preemption and is exiting: raised by ``maybe_save`` after the emergency
    save, so ``with manager:`` closes cleanly and the process exits with ``code`` (128 + the
    signal's number: 143 for SIGTERM, as if the signal had ended it). ``signal`` names it,
    ``step`` is the step saved and ``url`` where the checkpoint is."""

    def __init__(self, signal_name: str, step: int, url: str) -> None:
        super().__init__(128 + int(signal.Signals[signal_name]))
        self.signal = signal_name
        self.step = step
        self.url = url

    def __str__(self) -> str:
        return f"preempted by {self.signal}: step {self.step} saved at {self.url}"


@dataclass(frozen=True, slots=True)
class Trigger:
    """What every rank agreed on at a step boundary: the signal (the highest number seen on any
    rank) and how much of the grace period is left."""

    signal: str
    remaining_s: float

    @property
    def metadata(self) -> dict[str, str]:
        """The checkpoint's metadata (the catalog row's ``meta``) for an emergency save."""
        return {"trigger": "emergency", "signal": self.signal}


def leave(code: int) -> None:
    """End the process with ``code`` now, after flushing the logs and the standard streams,
    without running the native destructors (threads may be blocked in collectives of process
    groups that would be torn down then: torch aborts the process when that happens)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit_at_shutdown(code: int) -> None:
    """``leave(code)`` as the interpreter shuts down: the uploads given up on still run on
    threads."""
    atexit.register(leave, code)


def _say(text: str) -> None:
    """One line to stderr from a signal handler: ``os.write`` takes no lock the interrupted
    code may hold (``logging`` does)."""
    with contextlib.suppress(OSError):
        os.write(2, (text + "\n").encode())


class EmergencySave:
    """The signal handlers of one manager and the emergency save they lead to (see the module
    docstring). Construct on every rank; ``close`` restores the previous handlers."""

    def __init__(self, config: EmergencySaveConfig) -> None:
        self.config = config
        #: the first signal seen on this rank and when (``time.monotonic``), or None
        self.seen: tuple[int, float] | None = None
        #: signals received since the first
        self.extra = 0
        #: set once the emergency save's uploads were given up (grace ran out): ``close``
        #: then does not wait for them
        self.abandoned = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for number in config.numbers:
                self._previous[number] = signal.signal(number, self._handle)
        else:
            log.warning(
                "zephon: emergency_save: the manager was made outside the main thread, so this "
                "rank installs no signal handler; a signal to another rank still saves it"
            )

    def _handle(self, number: int, frame: Any) -> None:
        name = signal.Signals(number).name
        if self.seen is None:
            self.seen = (number, time.monotonic())
            if self.config.when == "now":
                _say(f"zephon: {name}: emergency save now, of the last step boundary's state")
            else:
                _say(f"zephon: {name}: emergency save at the next step boundary")
            return
        self.extra += 1
        if self.extra == 1:
            _say(f"zephon: {name} again: ignored while the emergency save completes")
            return
        _say(f"zephon: {name} a third time: passed on to the handler before Zephon's")
        previous = self._previous.get(number, signal.SIG_DFL)
        signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        signal.raise_signal(number)

    def due(self, group: Any) -> Trigger | None:
        """Collective on ``group`` (the manager's gloo group; None: one process): whether any
        rank saw a signal, by one all-reduce (MAX) of this rank's signal number and the time
        since it came. None when no rank did."""
        number, elapsed_ms = 0, 0
        if self.seen is not None:
            number = self.seen[0]
            elapsed_ms = int((time.monotonic() - self.seen[1]) * 1000)
        if group is not None:
            import torch
            import torch.distributed as dist

            values = torch.tensor([number, elapsed_ms], dtype=torch.int64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
            number, elapsed_ms = (int(v) for v in values.tolist())
        if number == 0:
            return None
        remaining = max(0.0, self.config.grace_s - elapsed_ms / 1000)
        return Trigger(signal.Signals(number).name, remaining)

    def run(
        self,
        trigger: Trigger,
        step: int,
        *,
        save: Callable[[], None],
        uploads: Callable[[], None] | None,
        where: Callable[[bool], str],
        record: Callable[[dict[str, Any]], None] | None,
    ) -> Preempted:
        """Make the emergency save of ``step`` and return the ``Preempted`` to raise.

        ``save()`` saves and commits the step (waiting for a background commit); ``uploads()``
        waits for the uploads to save_dir (None: the save went to save_dir directly), for at
        most what is left of the grace period; ``where(uploaded)`` is the checkpoint's URL;
        ``record(detail)`` (rank 0) records the event in the catalog. Logs one line (rank 0:
        ``record`` given)."""
        deadline = time.monotonic() + trigger.remaining_s
        started = time.monotonic()
        save()
        committed_s = time.monotonic() - started
        uploaded, problem = uploads is None, None
        if uploads is not None:
            uploaded, problem = self._wait(uploads, deadline)
            self.abandoned = not uploaded and problem is None
        if self.abandoned:
            _exit_at_shutdown(128 + signal.Signals[trigger.signal])
        url = where(uploaded)
        line = (
            f"zephon: {trigger.signal}: emergency save of step {step} committed in "
            f"{committed_s:.1f} s"
        )
        if uploads is not None and uploaded:
            line += f" and uploaded in {time.monotonic() - started:.1f} s"
        line += f" ({url})"
        if problem is not None:
            line += f"; its upload to save_dir failed ({problem}): the next start uploads it"
        elif not uploaded:
            line += (
                f"; its upload to save_dir did not finish within grace_s = "
                f"{self.config.grace_s:g} s: the next start resumes from it or uploads it"
            )
        if record is not None:
            detail = {"signal": trigger.signal, "url": url, "committed_s": round(committed_s, 3)}
            record({**detail, "uploaded": uploaded})
            log.warning("%s; exiting", line)
        return Preempted(trigger.signal, step, url)

    @staticmethod
    def _wait(uploads: Callable[[], None], deadline: float) -> tuple[bool, str | None]:
        """Run ``uploads()`` until ``deadline``: (whether it finished, its failure if any)."""
        outcome: list[str | None] = []

        def wait() -> None:
            try:
                uploads()
                outcome.append(None)
            except Exception as exc:  # noqa: BLE001 - reported in the line, the job exits anyway
                outcome.append(f"{type(exc).__name__}: {exc}")

        waiter = threading.Thread(target=wait, name="zephon-emergency-wait", daemon=True)
        waiter.start()
        waiter.join(max(0.0, deadline - time.monotonic()))
        if not outcome:
            return False, None
        return outcome[0] is None, outcome[0]

    def close(self) -> None:
        """Restore the handlers that were there before (main thread only)."""
        previous, self._previous = self._previous, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
