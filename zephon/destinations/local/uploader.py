"""The background upload of local-tier checkpoints to ``save_dir``, in step order, one step at a
time, retried until it succeeds or is superseded (docs/tiers.md).

Every rank runs one uploader thread; they talk over a gloo process group of their own
(``exchange.Exchange``: created at manager start, used by nothing else, every collective
entered once every rank arrived), so an upload never interleaves with the training loop's or
the manager's collectives, and an uploader that dies on one rank fails the others at once.

**What comes next** is rank 0's decision, broadcast to every rank, so every rank does the same
uploads in the same order: the oldest failed upload once its backoff passed (failed uploads
are retried in step order, and newer ones wait behind them), else the next queued one; a
failed step that retention would drop once the newer pending steps are on save_dir is
superseded instead: dropped, never uploaded, its local copy left to local retention, the
catalog told (an ``upload_superseded`` event). Then, for the step chosen:

1. rank 0 begins the save_dir save through the one save path (``Save.begin``: the catalog row
   ``pending``, refused there for a stale attempt) with a fresh save id, and plans local
   retention; one all-gather hands every rank rank 0's answer and rank 0 every rank's file
   entries (names, sizes, CRC32C). Rank 0 begins before any rank writes, so nothing is
   uploaded for a refused attempt;
2. every rank streams the files it wrote from its local directory into the save_dir payload
   (``attach``), checking that the CRC32C of what went out is the local manifest's: a local
   file that changed on disk is never uploaded (its upload fails before the object is
   completed);
3. one gather tells rank 0 that every rank is done; rank 0 adds the local manifest's entries,
   commits the marker (fence re-checked), marks the row committed with its timings, applies
   save_dir retention, and plans local retention again; one broadcast tells every rank the
   outcome.

An upload that fails is logged at once in one line and kept for a retry, its local copy kept;
every failure not yet reported is raised by ``wait_all`` (the manager's ``wait``, ``finish``
and ``close``), all of them in one exception. An upload refused for good (a stale attempt, or
a damaged local copy) is not retried and its local copy becomes removable: nothing it holds
can ever be uploaded. Failed uploads count as pending: ``max_pending_uploads`` bounds them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from zephon.attempts import Attempt
from zephon.collectives import Collectives
from zephon.destinations.local.exchange import Exchange, UploaderDiedError
from zephon.destinations.local.tier import LocalTier
from zephon.destinations.local.tracking import Tracker
from zephon.destinations.local.transfer import UPLOAD_THREADS, copy_verified
from zephon.destinations.local.upload_protocol import (
    UploadError,
    UploadJob,
    UploadProtocol,
    failure_reason,
    first_line,
)
from zephon.errors import StaleAttemptError
from zephon.gc import retention_drops
from zephon.locations import RunLocation

__all__ = [
    "UPLOAD_THREADS",
    "UploadError",
    "UploadJob",
    "Uploader",
    "UploaderDiedError",
    "UploadsFailedError",
    "copy_verified",
]

log = logging.getLogger("zephon")

#: the first retry of a failed upload waits this long; each next one twice as long, at most
#: ``RETRY_MAX_S`` (storage's own per-request retries have already run out by then)
RETRY_BASE_S = 1.0
RETRY_MAX_S = 30.0
#: how often an idle uploader looks for another rank's death notice
IDLE_POLL_S = 1.0


class UploadsFailedError(UploadError):
    """Uploads that failed since the last report, one line each: ``failures`` holds
    ``(step, exception)`` in step order; those not refused for good are being retried."""

    def __init__(self, message: str, failures: list[tuple[int, BaseException]]) -> None:
        super().__init__(message)
        self.failures = failures

    @property
    def steps(self) -> list[int]:
        return [step for step, _ in self.failures]


def _report(url: str, failures: list[tuple[int, BaseException, bool]]) -> None:
    """Raise every failure in one exception, one line each: a stale attempt's refusal itself
    (the job must stop; the others as a note), else an ``UploadsFailedError``."""
    if not failures:
        return
    lines = [
        f"  step {step}{'' if retried else ' (not retried)'}: {first_line(failure_reason(exc))}"
        for step, exc, retried in failures
    ]
    stale = next((exc for _, exc, _ in failures if isinstance(exc, StaleAttemptError)), None)
    if stale is not None:
        raise StaleAttemptError(
            f"{stale}; the uploads that failed:\n" + "\n".join(lines),
            current=getattr(stale, "current", None),
        ) from stale
    retried = sum(1 for *_, again in failures if again)
    raise UploadsFailedError(
        f"{len(failures)} upload(s) to {url} failed ({retried} being retried, their local "
        "copies kept; check that save_dir is reachable):\n" + "\n".join(lines),
        [(step, exc) for step, exc, _ in failures],
    ) from failures[0][1]


class Uploader(UploadProtocol):
    """The uploader thread of this rank and its queue."""

    def __init__(
        self,
        coll: Collectives,
        tier: LocalTier,
        remote: RunLocation,
        *,
        tracker: Tracker | None,
        attempt: Callable[[], Attempt],
        retain: Callable[[], Any],
        num_to_keep: int | None = None,
        keep_every_steps: int | None = None,
        dedup: bool = False,
    ) -> None:
        self.rank = coll.rank
        self.world_size = coll.world_size
        self.is_main = coll.is_main
        # Every rank creates the group at the same point (the manager's constructor).
        self.exchange = Exchange(coll.distributed, coll.rank, coll.world_size)
        self.tier = tier
        self.remote = remote
        self.tracker = tracker
        self._attempt = attempt
        self._retain = retain
        #: save_dir's retention, which decides when a failed upload is superseded
        self.num_to_keep = num_to_keep
        self.keep_every_steps = keep_every_steps
        #: the shard files go to save_dir as chunks (``dedup``; docs/dedup.md, "Layout", the tiers)
        self.dedup = dedup
        self.retry_base_s = RETRY_BASE_S
        self.retry_max_s = RETRY_MAX_S
        self._cond = threading.Condition()
        #: queued uploads in step order (None: the thread stops), and failed ones to retry
        self._incoming: deque[UploadJob | None] = deque()
        self._retrying: list[UploadJob] = []
        self._running: UploadJob | None = None
        #: rank 0: the decider found nothing to do yet (``wait_all`` may return)
        self._idle = False
        #: uploads attempted so far (a wait sees a retry happen)
        self._finished = 0
        #: queued, running and failed-to-retry uploads (the backpressure counts them all)
        self._pending = 0
        #: steps whose local copy must stay: queued, running, or failed for a reason that may
        #: pass (rank 0 plans local retention from it)
        self._unsettled: set[int] = set()
        #: failures not yet reported: step -> (exception, whether it is retried)
        self._failures: dict[int, tuple[BaseException, bool]] = {}
        #: rank 0: steps this uploader committed on save_dir
        self._uploaded: set[int] = set()
        #: the refusal of a stale attempt, once one was met: the job must stop
        self.stale: StaleAttemptError | None = None
        #: set once the uploader of any rank stopped: no rank uploads any more
        self.dead: UploaderDiedError | None = None
        self._thread = threading.Thread(target=self._loop, name="zephon-upload", daemon=True)
        self._thread.start()

    # -- the main thread's side ----------------------------------------------------------------

    def submit(self, job: UploadJob) -> None:
        """Queue the upload of a locally committed checkpoint (every rank, in step order)."""
        with self._cond:
            self._pending += 1
            self._unsettled.add(job.step)
            self._incoming.append(job)
            self._idle = False
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def backlog(self) -> tuple[int, float]:
        """``(pending uploads, seconds since the oldest of them was saved)``: the tier's lag
        behind save_dir, for metrics; ``(0, 0.0)`` when every upload is done."""
        with self._cond:
            jobs = [*self._incoming, *self._retrying, self._running]
            starts = [job.started for job in jobs if job is not None and not job.void]
            pending = self._pending
        oldest = max(0.0, time.monotonic() - min(starts)) if starts else 0.0
        return pending, oldest

    def wait_below(self, most: int) -> None:
        """Backpressure: wait while ``most`` or more uploads are pending (failed ones waiting
        for a retry count); raise if an uploader died."""
        with self._cond:
            while self._pending >= most and self.dead is None:
                self._cond.wait()
            if self.dead is not None:
                raise self.dead

    def wait_all(self) -> None:
        """Wait until no upload is queued or running, except those waiting behind a failed one
        (uploads go in step order) once it was retried since this call; raise every failure
        not reported yet and every upload still waiting, in one exception, one line each."""
        with self._cond:
            began = self._finished
            while self.dead is None and not (
                self._quiet() and (not self._retrying or self._finished > began)
            ):
                self._cond.wait()
            failures = [(s, e, again) for s, (e, again) in sorted(self._failures.items())]
            self._failures = {}
            if self._retrying:
                head = min(j.step for j in self._retrying)
                failures += [
                    (j.step, UploadError(f"waits behind the retry of step {head}"), True)
                    for j in self._incoming
                    if j is not None and not j.void
                ]
            dead = self.dead
        if dead is not None:
            raise dead
        _report(self.remote.store.url, failures)

    def _quiet(self) -> bool:
        """Under the lock: nothing runs, and nothing can until a retry's backoff passes."""
        if self._running is not None:
            return False
        if self.is_main:  # the decider looked at everything since the last change
            return self._idle
        return not (any(self._incoming) and not self._retrying)

    def close(self) -> None:
        """Stop the thread once the queue is done (failed uploads still waiting for a retry
        stay local: the next start uploads the newest); release the process group."""
        with self._cond:
            self._incoming.append(None)
            self._cond.notify_all()
        self._thread.join()
        self.exchange.close()

    # -- the uploader thread: what comes next ----------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                decision = self._decide() if self.is_main else self._follow()
                decision = self.exchange.broadcast(decision)
                kind, step = decision[0], decision[1]
                if kind == "stop":
                    return
                job = self._take(step)
                if kind == "drop":
                    self._drop(job, decision[2], decision[3])
                else:
                    self._run(job)
        except BaseException as exc:  # noqa: BLE001 - every rank must learn it, at once
            self._die(exc)

    def _decide(self) -> tuple[Any, ...]:
        """Rank 0: the next thing every uploader does, once there is one."""
        with self._cond:
            while True:
                if self._incoming and (
                    self._incoming[0] is None or (self._retrying and None in self._incoming)
                ):
                    return ("stop", None)  # failed uploads still waiting stay local
                wait: float = IDLE_POLL_S
                if self._retrying:
                    oldest = min(self._retrying, key=lambda j: j.step)
                    newer = self._newer_than(oldest.step)
                    if retention_drops(oldest.step, newer, self.num_to_keep, self.keep_every_steps):
                        by = sorted(s for s in newer if s > oldest.step)
                        return ("drop", oldest.step, by, self._plan_dropping(oldest.step))
                    now = time.monotonic()
                    if oldest.due <= now:
                        return ("upload", oldest.step)
                    wait = min(wait, oldest.due - now)
                elif self._incoming:
                    return ("upload", self._incoming[0].step)  # type: ignore[union-attr]
                self._idle = True  # nothing to do before a backoff passes or a job comes
                self._cond.notify_all()
                self._cond.wait(wait)
                self._idle = False
                self.exchange.check_alive()

    def _follow(self) -> tuple[Any, ...]:
        """Other ranks: wait until there is something rank 0 may decide on (a queued upload,
        a failed one, the end), then hear its decision."""
        with self._cond:
            while not self._incoming and not self._retrying:
                self._cond.wait(IDLE_POLL_S)
                self.exchange.check_alive()
        return ("follow", None)

    def _newer_than(self, step: int) -> list[int]:
        """Rank 0: the steps newer than ``step`` that are on save_dir or on their way."""
        queued = [j.step for j in self._incoming if j is not None and not j.void]
        retried = [j.step for j in self._retrying]
        return [s for s in (*queued, *retried, *self._uploaded) if s > step]

    def _plan_dropping(self, step: int) -> list[int]:
        """Rank 0: local retention once ``step`` is no longer protected."""
        with contextlib.suppress(Exception):
            return self._plan(self._attempt(), drop=step)
        return []

    def _take(self, step: int) -> UploadJob:
        """The job of ``step``: a failed one to retry, or the next queued one."""
        with self._cond:
            for job in self._retrying:
                if job.step == step:
                    self._retrying.remove(job)
                    self._running = job
                    return job
            while not self._incoming:
                self._cond.wait(IDLE_POLL_S)
                self.exchange.check_alive()
            job = self._incoming.popleft()
            if job is None or job.step != step:
                raise UploadError(
                    f"rank {self.rank}'s uploader holds step {job and job.step} where rank 0's "
                    f"holds {step}: every rank must save the same steps in the same order"
                )
            self._running = job
            return job

    def _run(self, job: UploadJob) -> None:
        outcome, exc = self._upload(job)
        with self._cond:
            self._running = None
            self._finished += 1
            if outcome.ok:
                self._pending -= 1
                self._unsettled.discard(job.step)
                self._failures.pop(job.step, None)
            else:
                if outcome.stale and not isinstance(exc, StaleAttemptError):
                    exc = StaleAttemptError(outcome.error, current=outcome.current)
                exc = exc or UploadError(outcome.error)
                self._failures[job.step] = (exc, not outcome.for_good)
                if outcome.stale:
                    self.stale = exc  # type: ignore[assignment]
                if outcome.for_good:
                    self._pending -= 1
                    self._unsettled.discard(job.step)
                else:
                    job.attempts += 1
                    delay = min(self.retry_base_s * 2 ** (job.attempts - 1), self.retry_max_s)
                    job.due = time.monotonic() + delay
                    self._retrying.append(job)
            self._cond.notify_all()

    def _drop(self, job: UploadJob, by: list[int], doomed: list[int]) -> None:
        """Every rank: a failed upload superseded by newer steps: never uploaded; its local
        copy goes to local retention; rank 0 tells the catalog."""
        with self._cond:
            self._running = None
            self._pending -= 1
            self._unsettled.discard(job.step)
            earlier = self._failures.pop(job.step, None)
            self._failures[job.step] = (
                UploadError(f"superseded by steps {by} (retention would drop it): not retried"),
                False,
            )
            self._cond.notify_all()
        if self.is_main:
            why = first_line(failure_reason(earlier[0])) if earlier else ""
            log.warning(
                "zephon: the upload of step %d to %s is superseded by steps %s (retention "
                "would drop it once they are uploaded): it is not retried",
                job.step,
                self.remote.checkpoint_url(job.step),
                by,
            )
            if self.tracker is not None:
                self.tracker.superseded(job.step, by, why)
        self.tier.delete(doomed, self.tracker)

    def _die(self, exc: BaseException) -> None:
        """This rank's uploader stops: every rank learns it (the store's death notice), and
        every wait on this rank raises from now on."""
        if isinstance(exc, UploaderDiedError):
            dead = exc
        else:
            reason = first_line(failure_reason(exc))
            self.exchange.announce_death(reason)
            log.error("zephon: the uploader of rank %d stopped: %s", self.rank, reason)
            dead = UploaderDiedError(
                f"the uploader of rank {self.rank} stopped ({reason}); no rank uploads any "
                "more: restart the job (its local checkpoints are uploaded by the next start)",
                rank=self.rank,
            )
            dead.__cause__ = exc
        with self._cond:
            self.dead = dead
            self._running = None
            self._cond.notify_all()
