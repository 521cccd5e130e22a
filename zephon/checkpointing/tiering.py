"""The checkpoint manager's side of the local tier (docs/manager.md, "Local tier"): the local
store (``tier.LocalTier``), this rank's uploader (``uploader.Uploader``) and their catalog
records, behind the few calls the manager makes at save, resume and close.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from catalog import Catalog
from storage import CheckpointStore, CheckpointWriter, Lineage
from zephon.attempts import Attempt
from zephon.checkpointing.collectives import Collectives
from zephon.checkpointing.tier import LocalTier
from zephon.checkpointing.tracking import LOCAL, Tracker
from zephon.checkpointing.uploader import Uploader, UploadJob
from zephon.config import CheckpointingConfig
from zephon.locations import RunLocation
from zephon.saving import Save

__all__ = ["Tiering"]


class Tiering:
    """Saves that commit into ``local_dir`` and upload to ``save_dir`` in the background.

    Construct on every rank at the same point (collectives: hostnames, the uploader's group).
    """

    def __init__(
        self,
        config: CheckpointingConfig,
        coll: Collectives,
        remote: RunLocation,
        catalog: Catalog | None,
        *,
        attempt: Callable[[], Attempt],
        retain: Callable[[], Any],
    ) -> None:
        assert config.local_dir is not None
        self.coll = coll
        self.max_pending = config.max_pending_uploads
        self.tracker = Tracker(catalog if coll.is_main else None, remote.name)
        self.tier = LocalTier(
            config.local_dir, remote.name, remote.storage_run, coll, config.local_num_to_keep
        )
        self.uploader = Uploader(
            coll,
            self.tier,
            remote,
            tracker=self.tracker,
            attempt=attempt,
            retain=retain,
            num_to_keep=config.num_to_keep,
            keep_every_steps=config.keep_every_steps,
        )

    @property
    def store(self) -> CheckpointStore:
        return self.tier.store

    def checkpoint_url(self, step: int) -> str:
        return self.tier.checkpoint_url(step)

    # -- saving ------------------------------------------------------------------------------

    def before_save(self) -> None:
        """A stale attempt, or a job whose uploader died on any rank, stops here; else wait
        while ``max_pending_uploads`` are pending (failed uploads waiting for a retry too)."""
        if self.uploader.dead is not None:
            raise self.uploader.dead
        if self.uploader.stale is not None:
            raise self.uploader.stale
        self.uploader.wait_below(self.max_pending)

    def begin(self, attempt: Attempt, step: int) -> Save:
        """Rank 0: the local save of ``step``."""
        return self.tier.begin(attempt, step, self.tracker)

    def committed(
        self,
        step: int,
        save: Save | None,
        writer: CheckpointWriter,
        timings: dict[str, float],
        started: float,
    ) -> None:
        """Every rank, after the local marker: rank 0 records the local replica; every rank
        queues the upload of the files it wrote."""
        timings["local_s"] = time.monotonic() - started
        if self.coll.is_main:
            assert save is not None
            manifest = save.committed()
            self.tracker.committed(step, LOCAL, manifest, {"local_s": timings["local_s"]})
        own = [] if self.coll.is_main else writer.entries  # a secondary writer's are its own
        job = UploadJob(step, writer.payload_path, own, timings, started, writer.save_id)
        self.uploader.submit(job)

    def failed(self, save: Save, exc: BaseException) -> None:
        """Rank 0: the local save failed."""
        self.tracker.failed(save.step, LOCAL, save.save_id, f"{type(exc).__name__}: {exc}")

    def wait(self) -> None:
        """No upload queued or running; every failure not reported yet raised, in one
        exception (``uploader.Uploader.wait_all``)."""
        self.uploader.wait_all()

    # -- resuming ----------------------------------------------------------------------------

    def candidate(self) -> int | None:
        """Collective: the local tier's newest checkpoint, if every rank holds it in full in
        its own local_dir (else None: save_dir is loaded). Whether the run's history admits
        it is judged when the resume point is chosen (``prefers``)."""
        step = self.coll.from_main(self.tier.newest, "look at the local tier")
        if step is None or not all(self.coll.all_gather(self.tier.holds(step))):
            return None
        return step

    def prefers(self, local: int | None, lineage: Lineage, remote: int | None) -> bool:
        """Rank 0, choosing the resume point: whether the local candidate ``local`` (every
        rank holds it) is still the local tier's newest under ``lineage`` and at least
        save_dir's latest ``remote``."""
        if local is None or (remote is not None and remote > local):
            return False
        manifest = self.tier.candidate(lineage)
        return manifest is not None and manifest.step == local

    def damaged(self, step: int, why: str) -> None:
        """Rank 0: the local copy of ``step`` failed verification: condemned there only."""
        self.tier.condemn(step, why)

    def upload_resumed(self, step: int) -> None:
        """Every rank: queue the upload of the local checkpoint resumed from, newer than
        save_dir's latest (rank 0 holds every file of it and uploads them all)."""
        self.uploader.submit(UploadJob(step, "", [], {}, time.monotonic()))

    def close(self) -> None:
        """Stop the uploader (after its queue), release the local store."""
        self.uploader.close()
        self.tier.close()
