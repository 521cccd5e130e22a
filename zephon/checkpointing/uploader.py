"""The background upload of local-tier checkpoints to ``save_dir``, in step order, one step at a
time (docs/manager.md, "Local tier").

Every rank runs one uploader thread; they talk over a gloo process group of their own (created
at manager start, used by nothing else), so an upload never interleaves with the training
loop's or the manager's collectives. For each step, in the same order on every rank:

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

An upload that fails is logged at once in one line and raised by ``wait_all`` (the manager's
``wait``, ``finish`` and ``close``); its local copy is kept, unless the upload was refused for
good (a stale attempt, or a damaged local copy): nothing it holds can ever be uploaded.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from storage import (
    CheckpointWriter,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    new_save_id,
    redact,
)
from zephon.attempts import Attempt, as_zephon_error
from zephon.checkpointing.collectives import Collectives
from zephon.checkpointing.tier import LocalTier
from zephon.checkpointing.tracking import LOCAL, SAVE_DIR, Tracker
from zephon.errors import StaleAttemptError, ZephonError
from zephon.locations import RunLocation
from zephon.saving import Save

__all__ = ["UPLOAD_THREADS", "UploadError", "UploadJob", "Uploader", "copy_verified"]

log = logging.getLogger("zephon")

_CHUNK = 8 << 20


class UploadError(ZephonError):
    """An upload of a local checkpoint to save_dir failed (on another rank, or for a reason
    that is not an exception of this process)."""


@dataclass
class UploadJob:
    """One local checkpoint to upload, as this rank knows it."""

    step: int
    #: the local save's payload directory on this rank
    local_payload: str
    #: the files this rank wrote (rank 0: ignored, it takes the local manifest's files that no
    #: other rank reports)
    own: list[FileEntry] = field(default_factory=list)
    #: phases measured so far (``stall_s``, ``stage_s``, ``local_s``), completed by the upload
    timings: dict[str, float] = field(default_factory=dict)
    #: when the save began (time.monotonic), for ``total_s``
    started: float = field(default_factory=time.monotonic)
    #: the local save id (for its replica row)
    local_save_id: str = ""
    #: rank 0: the local save never committed (its other ranks had already queued their
    #: part, e.g. the drop-in ``zephon.dcp.Writer``'s, which queue as their write ends): the
    #: job only keeps every rank's uploader in step; nothing is uploaded, nothing reported
    void: bool = False


@dataclass
class _Outcome:
    ok: bool
    error: str = ""
    for_good: bool = False
    doomed: list[int] = field(default_factory=list)
    #: refused because a newer attempt holds the run (``current`` describes it)
    stale: bool = False
    current: Any = None


def _reason(exc: BaseException) -> str:
    return redact(f"{type(exc).__name__}: {exc}")[:2000]


class Uploader:
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
    ) -> None:
        self.rank = coll.rank
        self.world_size = coll.world_size
        self.is_main = coll.is_main
        # Every rank creates the group at the same point (the manager's constructor).
        self.group = dist.new_group(backend="gloo") if coll.distributed else None
        self.tier = tier
        self.remote = remote
        self.tracker = tracker
        self._attempt = attempt
        self._retain = retain
        self._queue: queue.Queue[UploadJob | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0
        #: steps whose local copy must stay: queued, running, or failed for a reason that may
        #: pass (rank 0 plans local retention from it)
        self._unsettled: set[int] = set()
        self._failures: list[BaseException] = []
        #: the refusal of a stale attempt, once one was met: the job must stop
        self.stale: StaleAttemptError | None = None
        self._thread = threading.Thread(target=self._loop, name="zephon-upload", daemon=True)
        self._thread.start()

    # -- the main thread's side ----------------------------------------------------------------

    def submit(self, job: UploadJob) -> None:
        """Queue the upload of a locally committed checkpoint (every rank, in step order)."""
        with self._cond:
            self._pending += 1
            self._unsettled.add(job.step)
        self._queue.put(job)

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def wait_below(self, most: int) -> None:
        """Backpressure: wait while ``most`` or more uploads are pending."""
        with self._cond:
            while self._pending >= most:
                self._cond.wait()

    def wait_all(self) -> None:
        """Wait for every pending upload; raise the first failure (once)."""
        with self._cond:
            while self._pending:
                self._cond.wait()
            failures, self._failures = self._failures, []
        if failures:
            first = failures[0]
            if len(failures) > 1:
                first.add_note(f"({len(failures) - 1} more upload(s) failed; see the log)")
            raise first

    def close(self) -> None:
        """Stop the thread once the queue is empty; release the process group."""
        self._queue.put(None)
        self._thread.join()
        if self.group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
            self.group = None

    # -- the uploader thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                outcome, exc = self._upload(job)
            except BaseException as crash:  # noqa: BLE001 - a bug must not kill the queue
                outcome, exc = _Outcome(ok=False, error=_reason(crash)), crash
            with self._cond:
                self._pending -= 1
                if outcome.ok or outcome.for_good:
                    self._unsettled.discard(job.step)
                if outcome.stale and not isinstance(exc, StaleAttemptError):
                    exc = StaleAttemptError(outcome.error, current=outcome.current)
                if not outcome.ok:
                    self._failures.append(exc or UploadError(outcome.error))
                if outcome.stale:
                    self.stale = exc  # type: ignore[assignment]
                self._cond.notify_all()

    def _protected(self) -> set[int]:
        with self._cond:
            return set(self._unsettled)

    def _all_gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _gather(self, value: Any) -> list[Any] | None:
        if self.group is None:
            return [value]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, out, dst=0, group=self.group)
        return out

    def _broadcast(self, value: Any) -> Any:
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _upload(self, job: UploadJob) -> tuple[_Outcome, BaseException | None]:
        """One step's upload on this rank (the protocol in the module docstring)."""
        began = time.monotonic()
        step = job.step
        save: Save | None = None
        manifest: Manifest | None = None
        error: BaseException | None = None
        head: dict[str, Any] | None = None
        if self.is_main and job.void:
            head = {"ok": False, "void": True, "doomed": []}
        elif self.is_main:
            head, save, manifest, error = self._begin(job)
        mine = [e.to_dict() for e in job.own]
        everything = self._all_gather(head if self.is_main else mine)
        head = everything[0]
        if head.get("void"):
            return _Outcome(ok=True), None
        self.tier.delete(head["doomed"], self.tracker)
        if not head["ok"]:
            outcome = _Outcome(
                ok=False,
                error=head["error"],
                for_good=head["for_good"],
                stale=head["stale"],
                current=head["current"],
            )
            self._log_failure(step, outcome.error)
            return outcome, error

        status: str | None = None
        damaged = False
        try:
            if self.is_main:
                assert save is not None and manifest is not None
                others = {e["name"] for entries in everything[1:] for e in entries}
                own = [e for e in manifest.files if e.name not in others]
                copy_verified(own, self.tier.payload_path(manifest), save.writer)
            else:
                writer = self.remote.store.attach(
                    self.remote.storage_run, step, save_id=head["save_id"], fence=head["fence"]
                )
                copy_verified(job.own, job.local_payload, writer)
        except Exception as exc:
            error = exc
            damaged = isinstance(exc, CorruptCheckpointError)
            status = _reason(exc)
        statuses = self._gather((status, damaged))

        outcome = _Outcome(ok=True)
        if self.is_main:
            assert save is not None and manifest is not None and statuses is not None
            elsewhere = [FileEntry(**e) for entries in everything[1:] for e in entries]
            outcome, error = self._finish(job, save, manifest, elsewhere, statuses, error, began)
        outcome = self._broadcast(outcome)
        self.tier.delete(outcome.doomed, self.tracker)
        if not outcome.ok:
            self._log_failure(step, outcome.error)
            if error is None:
                error = UploadError(
                    f"the upload of step {step} to {self.remote.checkpoint_url(step)} failed: "
                    f"{outcome.error}"
                )
        return outcome, error

    def _begin(
        self, job: UploadJob
    ) -> tuple[dict[str, Any], Save | None, Manifest | None, BaseException | None]:
        """Rank 0: read the local manifest, begin the save_dir save, plan local retention."""
        doomed: list[int] = []
        attempt: Attempt | None = None
        save_id = ""
        try:
            attempt = self._attempt()
            manifest = self.tier.manifest(job.step)
            job.local_save_id = job.local_save_id or manifest.save_id
            save_id = new_save_id(attempt.fence)
            save = Save.begin(
                attempt,
                job.step,
                catalog=self.tracker.catalog if self.tracker is not None else None,
                save_id=save_id,
                metadata=manifest.metadata,
            )
        except Exception as exc:
            exc = as_zephon_error(exc)
            for_good = isinstance(exc, StaleAttemptError | CorruptCheckpointError)
            self._settle_local(job, exc, for_good)
            if save_id and self.tracker is not None:  # the upload was refused as it began
                url = self.remote.checkpoint_url(job.step)
                self.tracker.started(job.step, SAVE_DIR, url, save_id)
                self.tracker.failed(job.step, SAVE_DIR, save_id, _reason(exc))
            if attempt is not None:
                with contextlib.suppress(Exception):
                    doomed = self._plan(attempt, drop=job.step if for_good else None)
            head = {
                "ok": False,
                "error": _reason(exc),
                "for_good": for_good,
                "stale": isinstance(exc, StaleAttemptError),
                "current": getattr(exc, "current", None),
                "doomed": doomed,
            }
            return head, None, None, exc
        if self.tracker is not None:
            self.tracker.started(
                job.step, SAVE_DIR, self.remote.checkpoint_url(job.step), save.save_id
            )
        with contextlib.suppress(Exception):
            doomed = self._plan(attempt)
        head = {
            "ok": True,
            "save_id": save.save_id,
            "fence": attempt.fence,
            "doomed": doomed,
        }
        return head, save, manifest, None

    def _finish(
        self,
        job: UploadJob,
        save: Save,
        manifest: Manifest,
        elsewhere: list[FileEntry],
        statuses: list[tuple[str | None, bool]],
        error: BaseException | None,
        began: float,
    ) -> tuple[_Outcome, BaseException | None]:
        """Rank 0: commit the save_dir save if every rank uploaded its files, else fail it."""
        attempt = self._attempt()
        failed = [(rank, text) for rank, (text, _) in enumerate(statuses) if text is not None]
        damaged = any(flag for _, flag in statuses)
        if not failed:
            try:
                save.writer.add_entries(manifest.files)
                save.writer.add_entries(elsewhere)  # files of local directories not rank 0's
                save.commit()
                timings = dict(job.timings)
                now = time.monotonic()
                timings["upload_s"] = now - began
                timings["total_s"] = now - job.started
                committed = save.committed(timings=timings)
            except Exception as exc:
                error = as_zephon_error(exc)
                failed = [(0, _reason(error))]
            else:
                if self.tracker is not None:
                    self.tracker.committed(job.step, SAVE_DIR, committed, timings)
                try:
                    self._retain()
                except Exception as exc:  # noqa: BLE001 - the checkpoint is committed
                    log.warning(
                        "zephon: retention of save_dir after step %d failed: %s",
                        job.step,
                        _reason(exc),
                    )
                doomed: list[int] = []
                with self._cond:
                    self._unsettled.discard(job.step)
                with contextlib.suppress(Exception):
                    doomed = self._plan(attempt)
                return _Outcome(ok=True, doomed=doomed), None
        rank, text = failed[0]
        if error is None:
            error = UploadError(
                f"rank {rank} could not upload step {job.step} to "
                f"{self.remote.checkpoint_url(job.step)}: {text}"
            )
        save.failed(error)
        stale = isinstance(error, StaleAttemptError)
        for_good = stale or damaged
        if damaged:
            self.tier.condemn(job.step, text)
        self._settle_local(job, error, for_good)
        if self.tracker is not None:
            self.tracker.failed(job.step, SAVE_DIR, save.save_id, text)
        doomed = []
        with contextlib.suppress(Exception):
            doomed = self._plan(attempt, drop=job.step if for_good else None)
        outcome = _Outcome(
            ok=False,
            error=f"rank {rank}: {text}",
            for_good=for_good,
            doomed=doomed,
            stale=stale,
            current=getattr(error, "current", None),
        )
        return outcome, error

    def _settle_local(self, job: UploadJob, exc: BaseException, for_good: bool) -> None:
        """Rank 0: an upload refused for good marks the local replica failed with the reason
        (its files are then removable)."""
        if for_good and self.tracker is not None and job.local_save_id:
            self.tracker.failed(job.step, LOCAL, job.local_save_id, _reason(exc))

    def _plan(self, attempt: Attempt, drop: int | None = None) -> list[int]:
        protected = self._protected()
        if drop is not None:
            protected.discard(drop)
        return self.tier.doomed(protected, attempt.fence)

    def _log_failure(self, step: int, error: str) -> None:
        if not self.is_main:  # one line per failed upload, not one per rank
            return
        log.error(
            "zephon: upload of step %d to %s failed: %s",
            step,
            self.remote.checkpoint_url(step),
            error.splitlines()[0][:300] if error else "",
        )


#: files one rank uploads at once: each holds about a read chunk and an upload part in memory
UPLOAD_THREADS = 8


def copy_verified(
    files: list[FileEntry],
    local_payload: str,
    writer: CheckpointWriter,
    *,
    threads: int = UPLOAD_THREADS,
) -> None:
    """Stream each local file of ``local_payload`` into ``writer``, ``threads`` files at once,
    refusing one whose bytes are not its entry's (size and CRC32C, checked before the object
    is completed, so a local file damaged on disk is never published). The first failure is
    raised once the files under way have finished; no new file starts after it."""
    if not files:
        return
    failed = threading.Event()

    def copy(entry: FileEntry) -> None:
        if not failed.is_set():
            try:
                _copy_one(entry, local_payload, writer)
            except BaseException:
                failed.set()
                raise

    with ThreadPoolExecutor(
        max(1, min(threads, len(files))), thread_name_prefix="zephon-upload"
    ) as pool:
        futures = [pool.submit(copy, entry) for entry in files]
    for future in futures:
        future.result()


def _copy_one(entry: FileEntry, local_payload: str, writer: CheckpointWriter) -> None:
    path = f"{local_payload}/{entry.name}"
    try:
        source = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"local file {path} of step {writer.step} is missing; it cannot be uploaded",
            run=writer.run,
            step=writer.step,
            problems=[f"{entry.name}: missing"],
        ) from None
    with source, writer.open(entry.name) as out:
        while chunk := source.read(_CHUNK):
            out.write(chunk)
        if out.crc.size != entry.size or out.crc.encoded() != entry.crc32c:
            raise CorruptCheckpointError(
                f"local file {path} of step {writer.step} has {out.crc.size} bytes with "
                f"CRC32C {out.crc.encoded()}, its manifest says {entry.size} bytes "
                f"{entry.crc32c}: the local copy is damaged and is not uploaded",
                run=writer.run,
                step=writer.step,
                problems=[f"{entry.name}: checksum mismatch"],
            )
