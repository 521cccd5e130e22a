"""``CheckpointManager``: what a training or inference job calls to save every
``period_steps``, keep ``num_to_keep`` and resume exactly (docs/manager.md).

Call every method on every rank, at the same point of the program: they are collectives on a
gloo process group of the manager's own. Rank 0 alone talks to the catalog and commits.

This module is the public face only; the work is done by one module per job:

- ``job``: the checked arguments and the open parts (store, process group, the run session:
  catalog, attempt and retention, and the destination: save_dir or the local tier first);
- ``saver``: the save sequence, through ``zephon.saving.Save`` (the one fenced save path);
- ``background``: the pending ``async_save`` and its commit thread;
- ``loader``: the resume point, the load, and ``damage``: damaged checkpoints met on the way.

Errors: everything these methods raise on purpose is a ``zephon.ZephonError`` (a wrong state,
argument or configuration: ``ConfigError``; a newer attempt took over: ``StaleAttemptError``),
a ``zephon.StorageError`` (storage unreachable, a damaged checkpoint with ``on_corrupt: fail``:
``CorruptCheckpointError``; an absent source checkpoint: ``zephon.CheckpointNotFoundError``) or
a ``zephon.CatalogError`` (the catalog unreachable or refusing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from zephon.attempts import Attempt, fenced
from zephon.catalog import Catalog, CatalogUnavailableError
from zephon.checkpointing.background import Background
from zephon.checkpointing.instruments import Instruments
from zephon.checkpointing.job import ALREADY_COMPLETE, Job
from zephon.checkpointing.loader import Loader, Resume
from zephon.checkpointing.saver import Saver
from zephon.collectives import Collectives
from zephon.config import CheckpointingConfig, ModelStageConfig
from zephon.destinations import Destination
from zephon.emergency import EmergencySave
from zephon.locations import RunLocation
from zephon.outage import DebtBeingPaid, guard
from zephon.storage import CheckpointStore

__all__ = ["CheckpointManager", "Resume", "ALREADY_COMPLETE"]

log = logging.getLogger("zephon")


class CheckpointManager:
    """Saves and resumes one job's checkpoints under ``config.save_dir``.

    ``kind="train"`` needs ``run_name`` (checkpoints at ``<save_dir>/<run>/save-<step>``);
    ``kind="inference"`` has none (``<save_dir>/save-<step>``; its catalog name defaults to the
    last component of ``save_dir``). Steps count completed steps, from 1 to ``total_steps``.
    An invalid argument raises ``zephon.ConfigError``; an unreachable catalog or storage, a
    ``CatalogError`` or ``StorageError``.
    """

    def __init__(
        self,
        config: CheckpointingConfig,
        *,
        run_name: str | None = None,
        total_steps: int | None = None,
        kind: str = "train",
        model_stage: ModelStageConfig | None = None,
        catalog_name: str | None = None,
        save_rng: bool = True,
    ) -> None:
        self._job = Job(
            config,
            run_name=run_name,
            total_steps=total_steps,
            kind=kind,
            model_stage=model_stage,
            catalog_name=catalog_name,
            save_rng=save_rng,
        )
        self._background = Background()
        self._saver = Saver(self._job, self._background)
        self._loader = Loader(self._job)
        job = self._job
        # The job's parts that never change, for callers (tests, tools) that look at them.
        self.config: CheckpointingConfig = job.config
        self.kind: str = job.kind
        self.total_steps: int | None = job.total_steps
        self.model_stage: ModelStageConfig = job.model_stage
        #: the run's storage name (None for an inference job) and its catalog name
        self.run, self.name = job.run, job.name
        #: the store of ``save_dir`` and the run's place in it
        self.store: CheckpointStore = job.store
        self.location: RunLocation = job.location
        #: the manager's own process group
        self.coll: Collectives = job.coll
        #: save on preemption: the signal handlers (``zephon.emergency``), when configured
        self._emergency = (
            EmergencySave(config.emergency_save) if config.emergency_save is not None else None
        )
        #: ``when: now``: the boundary snapshots and the watcher thread (``zephon.emergency_now``)
        self._now: Any = None
        if self._emergency is not None and self._emergency.config.when == "now":
            from zephon.emergency_now import NowSave  # torch-heavy: only when configured

            self._now = NowSave(self._emergency, job, self._background, self._emergency_parts)
        #: ``period_steps: auto`` and rank 0's metrics (docs/goodput.md)
        self.instruments = Instruments(job, self._saver)

    # -- the job's parts that change: read from the job each time -------------------------------

    @property
    def catalog(self) -> Catalog | None:
        """Rank 0: the catalog, when one is configured (None on the other ranks)."""
        return self._job.catalog

    @property
    def destination(self) -> Destination:
        """Where saves go: save_dir directly, or the local tier first
        (``zephon.destinations``)."""
        return self._job.destination

    @property
    def tier(self) -> Destination | None:
        """The tier (``local_dir`` or ``memory_tier``) and its uploads, if configured."""
        return self._job.destination if self.config.tier is not None else None

    @property
    def attempt(self) -> Attempt | None:
        """Rank 0: this job's attempt, registered by ``load_latest`` (or the first save)."""
        return self._job.attempt

    # -- when -------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether the job saves after completing ``step``: every ``period_steps`` and at the
        last step; only at the last step; never; or, with ``auto``, when the period the job
        measured is due (docs/goodput.md)."""
        auto = self.instruments.should_save(step, self.total_steps)
        return self.config.saves_at(step, self.total_steps) if auto is None else auto

    def maybe_save(self, step: int, state: Mapping[str, Any], **kwargs: Any) -> bool:
        """``save`` if ``should_save(step)``; returns whether it saved.

        With ``emergency_save`` configured this is a collective at every step (one tiny
        all-reduce): after a listed signal on any rank, every rank saves ``step`` and raises
        ``zephon.Preempted`` (docs/manager.md, "Save on preemption"). With ``when: now`` it
        also copies the state into host memory, the copy an emergency save takes at once."""
        if self._now is not None:
            return self._boundary_now(step, state, **kwargs)
        if self._emergency is not None:
            self._save_if_preempted(step, state, kwargs.get("rank_state"))
        if not self.should_save(step):
            return False
        self.save(step, state, **kwargs)
        return True

    def _boundary_now(self, step: int, state: Mapping[str, Any], **kwargs: Any) -> bool:
        """``maybe_save`` with ``when: now``: copy the state of ``step`` for an emergency save
        (``zephon.emergency_now``), then the periodic save if due."""
        will_save = self.should_save(step)
        self._now.boundary(
            step, lambda: self._saver.prepare(state, kwargs.get("rank_state")), will_save
        )
        if not will_save:
            return False
        ok = False
        try:
            self.save(step, state, **kwargs)
            ok = True
        finally:
            self._now.snapshot.regular_done(ok)
        return True

    def _save_if_preempted(
        self, step: int, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None
    ) -> None:
        """Collective: if any rank saw a listed signal, save ``step`` (marked as an emergency
        save), wait for its upload for what is left of ``grace_s``, and raise ``Preempted``."""
        assert self._emergency is not None
        trigger = self._emergency.due(self.coll.group)
        if trigger is None:
            return

        def save() -> None:
            self._saver.save(step, state, rank_state, trigger.metadata)
            self._background.wait()  # an async save: its commit

        raise self._emergency.run(trigger, step, save=save, **self._emergency_parts(step))

    def _emergency_parts(self, step: int) -> dict[str, Any]:
        """``EmergencySave.run``'s ``uploads``, ``where`` and ``record`` for a save of
        ``step`` (both ``when`` settings)."""
        job = self._job

        def record(detail: dict[str, Any]) -> None:
            catalog = self.catalog
            if catalog is None:
                return
            try:
                catalog.record_event("emergency_save", run=self.name, step=step, detail=detail)
            except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; say so
                log.warning(
                    "zephon: the emergency save's event was not recorded in the catalog: %s: %s",
                    type(exc).__name__,
                    exc,
                )

        tiered = self.config.tier is not None  # the memory tier or the local tier
        return {
            "uploads": job.destination.wait if tiered else None,
            "where": lambda uploaded: (
                job.location.checkpoint_url(step)
                if uploaded or not tiered
                else job.destination.checkpoint_url(step)
            ),
            "record": record if self.coll.is_main else None,
        }

    # -- save -------------------------------------------------------------------------------

    def save(
        self, step: int, state: Mapping[str, Any], *, rank_state: Mapping[str, Any] | None = None
    ) -> None:
        """Save ``state`` as checkpoint ``step`` (collective).

        All ranks wait before and after. Tensors go through torch DCP (every rank writes its own
        shards), everything else as JSON; rank 0 commits the marker, then the catalog row, then
        applies retention. With ``async_save`` this returns once tensors are staged in host
        memory; the rest happens in the background and a failure is raised by the next call.
        A failure on any rank raises on every rank; nothing of the attempt is left behind.

        Raises ``zephon.ZephonError`` for a state it cannot save (``rank_state`` with tensors;
        another rank's failure names the rank), ``zephon.StaleAttemptError`` when a newer
        attempt of the run took over, ``zephon.StorageError`` and ``zephon.CatalogError`` when
        storage or the catalog fails.
        """
        started = time.monotonic()
        self._saver.save(step, state, rank_state)
        self.instruments.saved(step, time.monotonic() - started)

    def apply_retention(self) -> list[int]:
        """Rank 0: delete the checkpoints ``num_to_keep`` no longer keeps (docs/manager.md: after
        each save, the main process deletes the oldest). Returns the deleted steps."""
        return self._job.retain()

    def wait(self) -> None:
        """Wait for a background save and every pending upload; raise a failure, if one
        failed."""
        self._background.wait()
        self._job.destination.wait()

    # -- resume -------------------------------------------------------------------------------

    def load_latest(self, state: Mapping[str, Any], *, allow_partial_load: bool = False) -> Resume:
        """Load the latest complete checkpoint into ``state`` (collective) and say where to go.

        No checkpoint: a fresh start at step 1. Interrupted: continue from the step after the
        checkpoint (an inference job's data position makes it skip what it processed). Raised
        ``total_steps``: continue to the new last step. Finished: log "Training is already
        complete, nothing to do" (or "Inference ...") and return ``finished=True``.

        Registers this job's attempt (its fencing token), resuming from the step found: from
        then on an older attempt still running cannot save, mark or delete anything of the run.
        Every byte loaded is checked against its CRC32C (``verify_on_load``); a checkpoint that
        fails (or vanished meanwhile) is quarantined, one log line says so, and the next
        complete one is loaded, unless ``on_corrupt`` is ``"fail"``.

        Raises (each with a one-line message naming the checkpoint and the fix):
        ``zephon.ZephonError`` when ``state`` does not fit the checkpoint (other kinds of
        objects; ``zephon.dcp.StateDictMismatchError`` for missing or unexpected tensors), a
        checkpoint written by a newer Zephon, a trainable-only checkpoint without a source
        (``ConfigError``); ``zephon.StorageError`` when storage fails or, with ``on_corrupt:
        fail``, for the damaged checkpoint (``CorruptCheckpointError``; a shard gone is damage
        too); ``zephon.CheckpointNotFoundError`` when the source checkpoint of a trainable-only
        checkpoint is not there; ``zephon.CatalogError`` when the catalog fails.
        """
        self.wait()
        started = time.monotonic()
        resume = self._loader.load_latest(state, allow_partial_load)
        self._job.destination.resumed(resume.step)
        self.instruments.loaded(resume.step, time.monotonic() - started)
        return resume

    # -- end ------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for background work and mark the run finished in the catalog."""
        self.wait()
        catalog = self.catalog
        if catalog is not None:
            epoch = self.attempt.epoch if self.attempt is not None else None
            location, outage = self._job.location, guard(catalog)

            def mark_finished() -> None:
                catalog.update_run(self.name, status="finished", epoch=epoch)

            def pay_then_finish() -> None:
                outage.pay(location)
                mark_finished()

            with fenced():
                try:
                    outage.call(pay_then_finish)
                    return
                except (CatalogUnavailableError, DebtBeingPaid):
                    pass
                outage.defer(location, "finish", mark_finished)

    def close(self) -> None:
        """Wait for background work, then release the stager, the local tier, the catalog, the
        process group and the store. After an emergency save whose upload ran out of grace
        time, nothing is waited for: the process is exiting, the next start uploads it."""
        if self._now is not None:
            self._now.close()
        if self._emergency is not None:
            self._emergency.close()
            if self._emergency.abandoned:
                return
        try:
            self.wait()
        finally:
            self._background.close()
            self._job.close()
            self.instruments.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
