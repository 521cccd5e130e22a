"""One step's upload to ``save_dir`` across every rank's uploader (docs/tiers.md, "What a save
does"): rank 0 begins the save_dir save and every rank hears its answer, every rank streams the
files it wrote, rank 0 commits once every rank is done and every rank hears the outcome. The
uploader (``uploader.Uploader``) decides which step and when; this is the part every rank does
for one step, in the same order, over ``exchange.Exchange``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zephon.attempts import Attempt
from zephon.destinations.local.dedup import DedupPlan, local_reader, plan_upload
from zephon.destinations.local.exchange import Exchange
from zephon.destinations.local.tier import LocalTier
from zephon.destinations.local.tracking import LOCAL, SAVE_DIR, Tracker
from zephon.destinations.local.transfer import copy_verified, verified_sources
from zephon.errors import StaleAttemptError, ZephonError, as_zephon_error
from zephon.locations import RunLocation
from zephon.saving import Save
from zephon.storage import CorruptCheckpointError, FileEntry, Manifest, new_save_id, redact

__all__ = ["UploadError", "UploadJob", "UploadProtocol", "failure_reason", "first_line"]

log = logging.getLogger("zephon")


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
    #: failed attempts so far, and (rank 0) when the next one may start (time.monotonic)
    attempts: int = 0
    due: float = 0.0


@dataclass
class _Outcome:
    ok: bool
    error: str = ""
    for_good: bool = False
    doomed: list[int] = field(default_factory=list)
    #: refused because a newer attempt holds the run (``current`` describes it)
    stale: bool = False
    current: Any = None


def failure_reason(exc: BaseException) -> str:
    return redact(f"{type(exc).__name__}: {exc}")[:2000]


def first_line(text: str) -> str:
    return text.splitlines()[0][:300] if text else ""


class UploadProtocol:
    """One step's upload on this rank (mixed into ``uploader.Uploader``, which sets these)."""

    is_main: bool
    exchange: Exchange
    tier: LocalTier
    remote: RunLocation
    tracker: Tracker | None
    _attempt: Callable[[], Attempt]
    _retain: Callable[[], Any]
    _cond: threading.Condition
    _unsettled: set[int]
    _uploaded: set[int]
    #: store the shard files in save_dir as chunks (docs/dedup.md, "Layout", the tiers)
    dedup: bool = False
    #: rank 0, with ``dedup``: the save_dir checkpoint this uploader committed last (the next
    #: upload's base), and the plan of the upload under way
    _base: Manifest | None = None
    _plan: DedupPlan | None = None

    def _protected(self) -> set[int]:
        with self._cond:
            return set(self._unsettled)

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
        everything = self.exchange.all_gather(head if self.is_main else mine)
        head = everything[0]
        if head.get("void"):
            return _Outcome(ok=True), None
        self._replicate(job, everything)  # whatever save_dir answered: the peer copies first
        self.tier.delete(head["doomed"], self.tracker)
        if not head["ok"]:
            outcome = _Outcome(
                ok=False,
                error=head["error"],
                for_good=head["for_good"],
                stale=head["stale"],
                current=head["current"],
            )
            self._log_failure(step, outcome)
            return outcome, error
        plan: DedupPlan | None = None
        if self.dedup:  # every rank: the base's chunks and the shards' cut, from rank 0
            plan = self.exchange.broadcast(self._plan if self.is_main else None)
            self._plan = None

        status: str | None = None
        damaged = False
        last: list[FileEntry] = []  # rank 0's files the commit sends
        chunked: list[FileEntry] = []  # this rank's files stored as chunks (rank 0 lists them)
        try:
            if self.is_main:
                assert save is not None and manifest is not None
                others = {e["name"] for entries in everything[1:] for e in entries}
                own = [e for e in manifest.files if e.name not in others]
                if plan is not None:
                    save.writer.deduplicate(plan.base_map())
                    shards = [e for e in own if plan.cut(e) is not None]
                    own = [e for e in own if plan.cut(e) is None]
                    copy_verified(shards, self.tier.payload_path(manifest), save.writer, plan=plan)
                if len(everything) == 1:
                    # the only rank: its files go out with the commit's fence re-check, one
                    # round trip fewer (docs/fencing.md, the commit rule); with other ranks,
                    # the commit must list theirs once they are done, so rank 0 uploads its
                    # own beside them
                    last = own
                else:
                    copy_verified(own, self.tier.payload_path(manifest), save.writer)
            else:
                writer = self.remote.runstore.attach(
                    step, save_id=head["save_id"], fence=head["fence"]
                )
                if plan is not None:
                    writer.deduplicate(plan.base_map())
                copy_verified(job.own, job.local_payload, writer, plan=plan)
                chunked = [e for e in writer.entries if e.chunks is not None]
        except Exception as exc:
            error = exc
            damaged = isinstance(exc, CorruptCheckpointError)
            status = failure_reason(exc)
        statuses = self.exchange.gather((status, damaged, chunked))

        outcome = _Outcome(ok=True)
        if self.is_main:
            assert save is not None and manifest is not None and statuses is not None
            elsewhere = [FileEntry(**e) for entries in everything[1:] for e in entries]
            outcome, error = self._finish(
                job, save, manifest, elsewhere, last, statuses, error, began
            )
        outcome = self.exchange.broadcast(outcome)
        self.tier.delete(outcome.doomed, self.tracker)
        if not outcome.ok:
            self._log_failure(step, outcome)
            if error is None:
                error = UploadError(
                    f"the upload of step {step} to {self.remote.checkpoint_url(step)} failed: "
                    f"{outcome.error}"
                )
        return outcome, error

    def _replicate(self, job: UploadJob, everything: list[Any]) -> None:
        """Every rank, before the upload: copies of the checkpoint to other nodes, if the tier
        makes any (the memory tier's peers). ``everything``: rank 0's answer and every other
        rank's file entries. None here."""

    def _begin(
        self, job: UploadJob
    ) -> tuple[dict[str, Any], Save | None, Manifest | None, BaseException | None]:
        """Rank 0: read the local manifest (with ``dedup``: choose the base and plan the cut),
        begin the save_dir save, plan local retention."""
        doomed: list[int] = []
        attempt: Attempt | None = None
        save_id = ""
        try:
            attempt = self._attempt()
            manifest = self.tier.manifest(job.step)
            job.local_save_id = job.local_save_id or manifest.save_id
            if self.dedup:
                self._plan = plan_upload(
                    manifest,
                    self._dedup_base(),
                    local_reader(self.tier.payload_path(manifest)),
                )
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
                self.tracker.failed(job.step, SAVE_DIR, save_id, failure_reason(exc))
            if attempt is not None:
                with contextlib.suppress(Exception):
                    doomed = self._plan(attempt, drop=job.step if for_good else None)
            head = {
                "ok": False,
                "error": failure_reason(exc),
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
        last: list[FileEntry],
        statuses: list[tuple[str | None, bool, list[FileEntry]]],
        error: BaseException | None,
        began: float,
    ) -> tuple[_Outcome, BaseException | None]:
        """Rank 0: commit the save_dir save if every rank uploaded its files, else fail it.
        ``last``: rank 0's files not uploaded yet, sent with the commit."""
        attempt = self._attempt()
        failed = [(rank, text) for rank, (text, *_) in enumerate(statuses) if text is not None]
        damaged = any(flag for _, flag, _ in statuses)
        if not failed:
            try:
                # files stored as chunks (by rank 0, and those the other ranks report) are
                # listed with their chunks, not as the local marker's plain entries
                chunked = [e for _, _, entries in statuses for e in entries]
                save.writer.add_entries(chunked)
                held = {e.name for e in last} | {e.name for e in chunked}
                held |= {e.name for e in save.writer.entries if e.chunks is not None}
                save.writer.add_entries(e for e in manifest.files if e.name not in held)
                # files of local directories not rank 0's
                save.writer.add_entries(e for e in elsewhere if e.name not in held)
                payload = self.tier.payload_path(manifest)
                save.commit(files=verified_sources(last, payload, save.writer))
                timings = dict(job.timings)
                now = time.monotonic()
                timings["upload_s"] = now - began
                timings["total_s"] = now - job.started
                committed = save.committed(timings=timings)
            except Exception as exc:
                damaged = isinstance(exc, CorruptCheckpointError)  # a file sent with it
                error = as_zephon_error(exc)
                failed = [(0, failure_reason(error))]
            else:
                if self.tracker is not None:
                    self.tracker.committed(job.step, SAVE_DIR, committed, timings)
                if self.dedup:
                    self._base = committed  # save_dir's newest of the history now
                try:
                    self._retain()
                except Exception as exc:  # noqa: BLE001 - the checkpoint is committed
                    log.warning(
                        "zephon: retention of save_dir after step %d failed: %s",
                        job.step,
                        failure_reason(exc),
                    )
                doomed: list[int] = []
                with self._cond:
                    self._unsettled.discard(job.step)
                    self._uploaded.add(job.step)
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

    def _dedup_base(self) -> Manifest | None:
        """Rank 0: the base of a deduplicated upload: the save_dir checkpoint this uploader
        committed last, else save_dir's latest under the run's lineage (docs/dedup.md: the
        newest checkpoint of the history, which retention never deletes)."""
        if self._base is None:
            self._base = self.remote.runstore.latest()
        return self._base

    def _settle_local(self, job: UploadJob, exc: BaseException, for_good: bool) -> None:
        """Rank 0: an upload refused for good marks the local replica failed with the reason
        (its files are then removable)."""
        if for_good and self.tracker is not None and job.local_save_id:
            self.tracker.failed(job.step, LOCAL, job.local_save_id, failure_reason(exc))

    def _plan(self, attempt: Attempt, drop: int | None = None) -> list[int]:
        protected = self._protected()
        if drop is not None:
            protected.discard(drop)
        return self.tier.doomed(protected, attempt.fence)

    def _log_failure(self, step: int, outcome: _Outcome) -> None:
        if not self.is_main:  # one line per failed upload, not one per rank
            return
        log.error(
            "zephon: upload of step %d to %s failed%s: %s",
            step,
            self.remote.checkpoint_url(step),
            "" if outcome.for_good else " (it is retried)",
            first_line(outcome.error),
        )
