"""The one save path: a catalog row goes ``pending -> committed | failed`` around one fenced
storage save. The checkpoint manager, the tools and anything that saves later use ``Save``.

Order matters for crash safety and for fencing:

1. the catalog row is armed ``pending`` (a fenced transaction: a stale attempt is refused here,
   before writing anything), so gc and the resume probe know a save is under way;
2. storage ``begin`` (fenced again) gives the save a payload directory of its own;
3. files are written, then ``writer.commit()`` re-checks the fence and creates the marker;
4. the row is committed (fenced: a stale attempt's late marker is never recorded as history).

A crash between 3 and 4 is repaired by ``find_latest``'s probe or by gc (the marker and the
pending row name the same save). Every way out of the block that is not a commit marks the row
failed and removes the save's own files, never another save's, and never files a marker may
name (a marker request whose outcome is unknown: ``CheckpointWriter.abort`` keeps them).

With the catalog unreachable (``zephon.outage``), steps 1 and 4 are retried briefly and then
owed to the catalog: the save goes on under the storage fence alone (step 2 re-checks the epoch
on storage, as without a catalog), and the run's rows are reconciled with storage once the
catalog answers, before the next save arms its own row or by the background payer.

Timings: a save measures its own phases with ``time.perf_counter`` (begin -> commit call ->
marker created -> catalog commit) and records them on the row with the commit: ``write_s``,
``commit_s``, ``total_s`` (docs/catalog.md, Timings and replicas); callers add the phases they
measure themselves (``stall_s``, ``stage_s``) to ``committed()`` or, when known only later,
to ``add_timings()``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from zephon.attempts import Attempt, fenced
from zephon.catalog import Catalog, CatalogUnavailableError, InvalidTransitionError
from zephon.errors import NotCommittedError, as_zephon_error
from zephon.outage import DebtBeingPaid, guard
from zephon.reconcile import manifest_facts
from zephon.storage import CheckpointWriter, Manifest, new_save_id, redact

__all__ = ["Save", "manifest_facts"]

log = logging.getLogger("zephon")

#: how long a save waits for a gc that is deleting the step it wants (a stale checkpoint there)
_DELETING_WAIT_S = 30.0


class Save:
    """One save of ``step`` by ``attempt``; make it with ``Save.begin`` on the one process
    that commits (rank 0), write through ``writer``, call ``commit()`` (or ``writer.commit()``)
    and then ``committed()``. Or use it as a context manager: a clean block that committed
    records the commit, anything else fails the save. A stale attempt's refusal is always
    ``zephon.StaleAttemptError``.
    """

    def __init__(
        self,
        attempt: Attempt,
        step: int,
        writer: CheckpointWriter,
        catalog: Catalog | None,
        *,
        began: float | None = None,
        armed: bool | None = None,
    ) -> None:
        self.attempt = attempt
        self.step = step
        self.writer = writer
        self.catalog = catalog
        #: whether the catalog holds this save's pending row (not when it was unreachable)
        self.armed = catalog is not None if armed is None else armed
        self._settled = False
        #: phase -> seconds of this save, complete once ``committed()`` returned
        self.timings: dict[str, float] = {}
        self._began = time.perf_counter() if began is None else began
        self._commit_started: float | None = None
        self._marker_at: float | None = None
        self._time_commits(writer)

    def _time_commits(self, writer: CheckpointWriter) -> None:
        """Note when ``writer.commit()`` starts and when its marker exists, whoever calls it
        (``Save.commit``, a ``with`` block, or the DCP writer holding ``writer``): the
        boundaries of ``write_s`` and ``commit_s``. Only this save's writer is wrapped."""
        commit = writer.commit

        @functools.wraps(commit)
        def timed_commit(*args: Any, **kwargs: Any) -> Manifest:
            self._commit_started = time.perf_counter()
            manifest = commit(*args, **kwargs)
            self._marker_at = time.perf_counter()
            return manifest

        writer.commit = timed_commit  # type: ignore[method-assign]

    @property
    def save_id(self) -> str:
        return self.writer.save_id

    @classmethod
    def begin(
        cls,
        attempt: Attempt,
        step: int,
        *,
        catalog: Catalog | None = None,
        metadata: Mapping[str, Any] | None = None,
        save_id: str | None = None,
    ) -> Save:
        """Arm the row and begin the storage save. Raises ``zephon.StaleAttemptError`` when
        ``attempt`` is no longer current, ``zephon.SaveBelowLatestError`` for a step below the
        latest checkpoint an implicit attempt continues (``Attempt.check_save``); a failed
        storage begin leaves the row failed.

        ``save_id`` is a fresh id from ``storage.new_save_id`` chosen earlier, when other
        processes must know it before the save begins (they ``attach`` to it); by default a
        new one is drawn here."""
        began = time.perf_counter()
        attempt.check_save(step)  # a job that started over by mistake: before anything is written
        location = attempt.location
        save_id = save_id if save_id is not None else new_save_id(attempt.fence)
        with fenced():
            armed = catalog is not None and _arm_unless_down(catalog, attempt, step, save_id)
            try:
                writer = location.runstore.begin(
                    step,
                    fence=attempt.fence,
                    save_id=save_id,
                    metadata=metadata,
                    # the catalog's fenced begin just checked the epoch in its transaction;
                    # without it (none, or unreachable) storage checks it
                    recheck=not armed,
                )
            except BaseException as exc:
                if armed:
                    with contextlib.suppress(Exception):
                        catalog.mark_failed(location.name, step, save_id, _reason(exc))
                raise
        return cls(attempt, step, writer, catalog, began=began, armed=armed)

    def commit(
        self,
        metadata: Mapping[str, Any] | None = None,
        *,
        files: Mapping[str, Any] | None = None,
        inline: Iterable[str] = (),
    ) -> Manifest:
        """``writer.commit(metadata, files=..., inline=...)`` (the last files with the fence
        re-check, then the marker), a stale attempt's refusal raised as
        ``zephon.StaleAttemptError``. Then call ``committed()``."""
        with fenced():
            return self.writer.commit(metadata, files=files, inline=inline)

    def committed(self, timings: Mapping[str, float] | None = None) -> Manifest:
        """Record the commit in the catalog, after ``writer.commit()`` created the marker,
        with the save's timings: ``write_s`` (begin to the commit call), ``commit_s`` (the
        commit call to the marker), ``total_s`` (begin to this call), merged with
        ``timings``, the phases the caller measured (``stall_s``, ``stage_s``...; a key given
        here wins over the measured one). ``self.timings`` holds the result."""
        manifest = self.writer.manifest
        if manifest is None:
            raise NotCommittedError(
                f"checkpoint {self.writer.url} was not committed: call writer.commit() once "
                "every file is written"
            )
        self._settled = True
        self.timings.update(self._measured())
        self.timings.update(timings or {})
        if self.catalog is not None:
            self._record(self.catalog, manifest)
        return manifest

    def _record(self, catalog: Catalog, manifest: Manifest) -> None:
        """``mark_committed`` of the armed row, retried briefly while the catalog is
        unreachable, then owed (the rows are reconciled with storage once it answers). A save
        that could not arm its row pays the run's debt now if the catalog is back."""
        location = self.attempt.location
        outage = guard(catalog)
        with fenced():
            try:
                if not self.armed:
                    # owed again now that the marker exists: a payment made since begin may
                    # have listed the run before it
                    outage.defer_rows(location)
                    outage.call(lambda: outage.pay(location))
                    return
                outage.call(
                    lambda: catalog.mark_committed(
                        location.name,
                        self.step,
                        self.save_id,
                        epoch=self.attempt.epoch,
                        timings=self.timings,
                        **manifest_facts(manifest),
                    )
                )
            except (CatalogUnavailableError, DebtBeingPaid):
                outage.defer_rows(location)
                log.warning(
                    "zephon: run %s step %d is committed on storage; its catalog row is "
                    "recorded once the catalog answers",
                    location.name,
                    self.step,
                )

    def add_timings(self, timings: Mapping[str, float]) -> None:
        """Merge phases measured after the commit (an async save's stall, an upload) into
        ``self.timings`` and the save's catalog row. Raises the catalog's
        ``CheckpointRecordNotFoundError`` when the row belongs to a newer save of the step now,
        ``InvalidValueError`` for an unknown phase (both ``zephon.CatalogError``)."""
        if self.catalog is not None and not guard(self.catalog).down:
            # timings are facts about a save, never worth failing a job for
            with contextlib.suppress(CatalogUnavailableError):
                self.catalog.add_timings(
                    self.attempt.location.name, self.step, self.save_id, dict(timings)
                )
        self.timings.update(timings)

    def _measured(self) -> dict[str, float]:
        now = time.perf_counter()
        measured = {"total_s": now - self._began}
        if self._commit_started is not None and self._marker_at is not None:
            measured["write_s"] = self._commit_started - self._began
            measured["commit_s"] = self._marker_at - self._commit_started
        return measured

    def failed(self, exc: BaseException) -> None:
        """The save did not complete: remove its own files, mark its row failed. Never
        raises (it runs while another error is on its way out)."""
        if self._settled:
            return
        self._settled = True
        with contextlib.suppress(Exception):
            self.writer.abort()
        if self.catalog is not None and self.armed:
            with contextlib.suppress(Exception):
                self.catalog.mark_failed(
                    self.attempt.location.name, self.step, self.save_id, _reason(exc)
                )

    def __enter__(self) -> CheckpointWriter:
        return self.writer

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.failed(exc)
            translated = as_zephon_error(exc)
            if translated is not exc:  # writer.commit() inside the block met a newer attempt
                raise translated
            return
        if self.writer.manifest is None:
            error = NotCommittedError(
                f"checkpoint {self.writer.url} was not committed inside the block; call "
                "writer.commit() once every file is written"
            )
            self.failed(error)
            raise error
        self.committed()


def _arm_unless_down(catalog: Catalog, attempt: Attempt, step: int, save_id: str) -> bool:
    """Pay what the run owes the catalog (its attempt first), then arm this save's pending
    row; False if the catalog stays unreachable through the retries (the row is owed then).
    ``zephon.CatalogOutageError`` once it has been unreachable past the deadline."""
    location = attempt.location
    outage = guard(catalog)
    url = location.checkpoint_url(step)

    def pay_then_arm() -> bool:
        outage.pay(location)  # the attempt and the rows first: the arm is fenced by them
        _arm(catalog, location.name, step, url, attempt, save_id)
        return True

    try:
        armed = outage.call(pay_then_arm)
    except (CatalogUnavailableError, DebtBeingPaid):
        armed = False
    if not armed:
        outage.defer_rows(location)
    return armed


def _arm(catalog: Catalog, name: str, step: int, url: str, attempt: Attempt, save_id: str) -> None:
    """``begin_checkpoint``, waiting a little for a gc that is deleting a stale checkpoint of
    this step (its claim excludes the re-arm until the marker is gone)."""
    deadline = time.monotonic() + _DELETING_WAIT_S
    while True:
        try:
            catalog.begin_checkpoint(name, step, url, epoch=attempt.epoch, save_id=save_id)
            return
        except InvalidTransitionError as exc:
            if getattr(exc, "state", None) != "deleting" or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _reason(exc: BaseException) -> str:
    """Why a save failed, as the catalog stores it: never with a secret in it."""
    return redact(f"{type(exc).__name__}: {exc}")[:2000]
