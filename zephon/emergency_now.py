"""``emergency_save.when: now``: save on preemption without waiting for the next step boundary
(docs/manager.md, "Save on preemption"), for jobs whose steps outlast the grace period.

A save must never capture a torn state (an optimizer step half applied), and only the training
loop knows where a step ends. So "now" saves, at once, the state as it was at the LAST step
boundary:

1. every ``maybe_save(step, state)`` (the boundary) runs one barrier on the manager's group, so
   the ranks' boundaries line up, then copies this rank's part of a save of ``step`` into host
   memory (``Snapshot.take``: the manager's own ``Saver.prepare``, its tensors copied into the
   reused buffers of a ``zephon.dcp.ZephonStager``, its JSON parts copied): one memory copy of
   the state per step, the price of the option;
2. a watcher thread per rank (``NowSave``) learns of a listed signal without the main thread:
   the signal's C-level handler writes its number to a pipe (``signal.set_wakeup_fd``), which
   wakes the watcher even while the main thread is inside a long native call; the watcher then
   sets a key in the job's rendezvous store (the TCPStore every process group shares), which
   the other ranks' watchers poll, so a signal to one rank reaches every rank;
3. every watcher freezes its snapshot (the main thread's next boundary blocks before copying:
   it never overwrites buffers being saved), then the watchers agree on one step, the highest
   snapshot of any rank: a rank one boundary behind lets its main thread take that one
   snapshot more (the barrier of 1. makes that a matter of one copy, never of a step) and
   waits for a periodic save of the main thread to finish; all of it on process groups of
   their own (``Collectives`` made at manager start), never the training loop's;
4. the save goes through the manager's one save path (``Saver`` on those groups: the fastest
   tier, committed and fenced, ``trigger: emergency``; the event in the catalog), then
   ``EmergencySave.run`` waits for the upload within what is left of ``grace_s`` and rank 0
   logs the line, exactly as with ``when: step``;
5. the process then ends with the signal's code (143 for SIGTERM) by ``os._exit`` after
   flushing the logs and the standard streams (``zephon.emergency.leave``): the main thread is
   inside a step, possibly inside a collective whose peers are exiting too, so it cannot be
   unwound cleanly; ``with manager:`` does not close, which costs nothing the next start needs
   (the checkpoint is committed; what its upload did not finish, the next start uploads).

The checkpoint is the state after step N (the last boundary): the next start resumes at N + 1
and, with deterministic steps, computes the same losses as a run never interrupted. A second
signal during the save is logged and ignored (``EmergencySave``); a third ends the process at
once (the save under way is then not committed, never torn).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from zephon import dcp as zdcp
from zephon.checkpointing.background import Background
from zephon.checkpointing.job import Job
from zephon.checkpointing.saver import PreparedState, Saver
from zephon.collectives import Collectives
from zephon.emergency import EmergencySave, Trigger, leave
from zephon.errors import ZephonError

__all__ = ["NowSave", "Snapshot"]

log = logging.getLogger("zephon")

#: how often a watcher looks at the rendezvous store for another rank's signal
POLL_S = 0.05
#: the shortest timeout of the emergency process groups (a longer grace_s: that)
_MIN_TIMEOUT_S = 10.0


class Snapshot:
    """This rank's part of a save of the last step boundary, in host memory, and its freeze.

    The main thread calls ``take`` at each boundary and ``regular_done`` after a periodic save;
    the watcher calls ``freeze`` and ``allow``. Once frozen, ``take`` of a step past the limit
    blocks for good (the process ends from the watcher), so the buffers being saved are never
    overwritten."""

    def __init__(self) -> None:
        self._stager: zdcp.ZephonStager | None = None
        self._cond = threading.Condition()
        #: the step of the copy, and the copy (None before the first boundary)
        self.step: int | None = None
        self.prepared: PreparedState | None = None
        #: the periodic save the main thread decided at the boundary of ``step`` and is making
        self._regular: int | None = None
        #: the last step a periodic save of the main thread completed
        self.saved: int | None = None
        #: frozen: the highest step ``take`` may still copy (None: not frozen)
        self._limit: int | None = None

    def take(self, step: int, prepare: Callable[[], PreparedState], will_save: bool) -> None:
        """Main thread, at the boundary of ``step``: copy ``prepare()`` (tensors into the
        reused host buffers); ``will_save``: a periodic save of ``step`` follows (call
        ``regular_done`` after it). Blocks for good when frozen below ``step``."""
        with self._cond:
            while self._limit is not None and step > self._limit:
                self._cond.wait()
            prepared = prepare()
            if self._stager is None:
                self._stager = zdcp.ZephonStager()
            self.prepared = PreparedState(
                layout=prepared.layout,
                tensors=self._stager.stage(prepared.tensors),
                shared=copy.deepcopy(prepared.shared),
                own=copy.deepcopy(prepared.own),
            )
            self.step = step
            self._regular = step if will_save else None
            self._cond.notify_all()

    def regular_done(self, ok: bool) -> None:
        """Main thread, after the periodic save of the last boundary (``ok``: it committed)."""
        with self._cond:
            if ok:
                self.saved = self._regular
            self._regular = None
            self._cond.notify_all()

    def freeze(self) -> int | None:
        """Watcher: no copy past the current one from now on (waits for a copy under way).
        The step of the current copy."""
        with self._cond:
            self._limit = self.step if self.step is not None else 0
            return self.step

    def allow(self, target: int, timeout: float) -> bool:
        """Watcher, once frozen: let the main thread copy up to ``target`` and wait until the
        copy is of ``target`` and no periodic save is under way; whether that happened within
        ``timeout`` seconds."""
        with self._cond:
            self._limit = max(self._limit or 0, target)
            self._cond.notify_all()
            return self._cond.wait_for(
                lambda: self.step == target and self._regular is None, timeout
            )

    def close(self) -> None:
        """Release the host buffers."""
        with self._cond:
            stager, self._stager = self._stager, None
            self.prepared = None
        if stager is not None:
            stager.close()


@dataclass(frozen=True, slots=True)
class Signalled:
    """A listed signal, as the watcher learnt of it: its number and when (``time.time()``: the
    ranks compare it, so wall clock)."""

    number: int
    at: float


class Channel:
    """How a watcher learns that some rank received a listed signal, without the main thread:
    this rank's wakeup pipe (``signal.set_wakeup_fd``; installed from the main thread, the
    previous one restored by ``close``) and a key in the job's rendezvous store."""

    def __init__(self, emergency: EmergencySave, coll: Collectives) -> None:
        self.emergency = emergency
        self.numbers = set(emergency.config.numbers)
        self._pipe: tuple[int, int] | None = None
        if threading.current_thread() is threading.main_thread():
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            if previous == -1:
                self._pipe = (read, write)
            else:  # someone else's (an asyncio loop's): keep it; the handler's flag serves
                signal.set_wakeup_fd(previous)
                os.close(read)
                os.close(write)
                log.warning(
                    "zephon: emergency_save when: now: a wakeup fd is already installed, so a "
                    "signal is noticed once the main thread runs Python code"
                )
        self._store: Any = None
        self._key = ""
        if coll.distributed and coll.group is not None:
            self._store = dist.distributed_c10d._get_default_store()  # shared by every group
            self._key = f"zephon/emergency/{coll.group.group_name}"

    def _local(self, timeout: float) -> Signalled | None:
        """A listed signal to this rank, waiting up to ``timeout``."""
        if self._pipe is not None:
            ready, _, _ = select.select([self._pipe[0]], [], [], timeout)
            if ready:
                with contextlib.suppress(BlockingIOError):
                    for number in os.read(self._pipe[0], 512):
                        if number in self.numbers:
                            return Signalled(number, time.time())
        else:
            time.sleep(timeout)
        seen = self.emergency.seen  # the Python-level handler ran (or no pipe)
        if seen is not None:
            return Signalled(seen[0], time.time() - (time.monotonic() - seen[1]))
        return None

    def wait(self, stop: threading.Event) -> Signalled | None:
        """Block until a listed signal reached this rank (then tell the others) or another
        rank; None once ``stop`` is set."""
        while not stop.is_set():
            mine = self._local(POLL_S)
            if mine is not None:
                if self._store is not None:
                    self._store.set(self._key, f"{mine.number} {mine.at!r}")
                return mine
            if self._store is not None and self._store.check([self._key]):
                number, at = self._store.get(self._key).decode().split()
                return Signalled(int(number), float(at))
        return None

    def close(self) -> None:
        """Restore the wakeup fd (main thread) and close the pipe."""
        pipe, self._pipe = self._pipe, None
        if pipe is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            for fd in pipe:
                os.close(fd)
        # else: a manager closed off the main thread leaves the fd installed (and open)


class NowSave:
    """``when: now`` for one manager (see the module docstring). Construct on every rank at
    the same point (it makes process groups); the main thread calls ``boundary`` from
    ``maybe_save`` and ``close`` from the manager's ``close``.

    ``parts(step)`` gives ``EmergencySave.run`` its ``uploads``, ``where`` and ``record``
    (the manager's, the same as with ``when: step``)."""

    def __init__(
        self,
        emergency: EmergencySave,
        job: Job,
        background: Background,
        parts: Callable[[int], dict[str, Any]],
    ) -> None:
        self.emergency = emergency
        self.job = job
        self.parts = parts
        self.snapshot = Snapshot()
        # Groups of the emergency's own: its collectives run on the watcher thread while the
        # main thread may sit in any collective of its own. A collective that outlasts the
        # grace period has no purpose (the scheduler kills the job then).
        timeout = max(_MIN_TIMEOUT_S, emergency.config.grace_s)
        self.coll = Collectives(dt.timedelta(seconds=timeout))
        self.saver = Saver(job, background, coll=self.coll, asynchronous=False)
        self.channel = Channel(emergency, self.coll)
        self._stop = threading.Event()
        self._responding = threading.Event()
        #: the process's end (tests of one process replace it)
        self.exit: Callable[[int], None] = leave
        self._thread = threading.Thread(target=self._watch, name="zephon-emergency", daemon=True)
        self._thread.start()

    # -- main thread ----------------------------------------------------------------------------

    def boundary(self, step: int, prepare: Callable[[], PreparedState], will_save: bool) -> None:
        """Collective, at ``maybe_save(step)``: line the ranks up (one barrier), then copy
        this rank's part of a save of ``step`` (blocks for good once an emergency save of an
        earlier step is under way)."""
        self.job.coll.barrier()
        self.snapshot.take(step, prepare, will_save)

    def close(self) -> None:
        """Stop the watcher (if it is saving, wait: it ends the process), restore the wakeup
        fd, release the buffers and the groups."""
        self._stop.set()
        if self._responding.is_set():
            self._thread.join()
        self._thread.join(timeout=10 * POLL_S + 1)
        self.channel.close()
        self.snapshot.close()
        self.coll.destroy()

    # -- the watcher thread ----------------------------------------------------------------------

    def _watch(self) -> None:
        got = self.channel.wait(self._stop)
        if got is None:
            return
        self._responding.set()
        name = signal.Signals(got.number).name
        try:
            self._respond(Trigger(name, self.emergency.config.grace_s - (time.time() - got.at)))
        except BaseException as exc:  # noqa: BLE001 - the job ends either way: say why
            log.error(
                "zephon: %s: the emergency save failed (%s: %s); exiting",
                name,
                type(exc).__name__,
                exc,
            )
        self.exit(128 + got.number)

    def _respond(self, trigger: Trigger) -> None:
        """Agree on the step with every rank, save it (unless a periodic save of it
        committed), and wait for the other ranks before the process ends."""
        mine = self.snapshot.freeze()
        target = max(self.coll.all_gather(-1 if mine is None else mine))
        if target < 0:
            if self.coll.is_main:
                log.warning(
                    "zephon: %s: no step boundary was reached yet: nothing to save; exiting",
                    trigger.signal,
                )
            return
        ready = self.snapshot.allow(target, max(1.0, trigger.remaining_s))
        problem = None if ready else ZephonError(f"the state of step {target} was not copied")
        self.coll.agree(problem, f"take the state of step {target} within grace_s")
        prepared = self.snapshot.prepared
        assert prepared is not None
        saved = all(self.coll.all_gather(self.snapshot.saved == target))

        def save() -> None:
            if saved:  # a periodic save of the step committed already: that is the save
                self.saver.background.wait()  # its commit, if it was an async save
            else:
                self.saver.save(target, {}, None, trigger.metadata, prepared=prepared)

        self.emergency.run(trigger, target, save=save, **self.parts(target))
        # rank 0 hosts the rendezvous store: every rank leaves after the others are done
        self.coll.barrier()
