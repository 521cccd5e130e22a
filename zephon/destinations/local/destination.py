"""The tiered destination (docs/tiers.md): a save commits into ``local_dir`` and returns; the
local store (``tier.LocalTier``), this rank's uploader (``uploader.Uploader``) and their
catalog records (``tracking.Tracker``) do the rest, behind the ``Destination`` calls.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from zephon.collectives import Collectives
from zephon.destinations.base import Destination
from zephon.destinations.local.config import TierConfig
from zephon.destinations.local.tier import LocalTier
from zephon.destinations.local.tracking import LOCAL, Tracker
from zephon.destinations.local.uploader import Uploader, UploadJob
from zephon.saving import Save
from zephon.storage import CheckpointWriter, Lineage

if TYPE_CHECKING:
    from zephon.attempts import Attempt
    from zephon.session import RunSession

__all__ = ["TieredDestination"]


class TieredDestination(Destination):
    """Saves that commit into ``local_dir`` and upload to ``save_dir`` in the background.

    Construct on every rank at the same point (collectives: the catalog opened on rank 0,
    hostnames, the uploader's own process group).
    """

    def __init__(self, session: RunSession, config: TierConfig, coll: Collectives) -> None:
        remote = session.location

        def open_catalog_on_main() -> None:
            _ = session.catalog  # the tracker records the replicas there

        coll.from_main(open_catalog_on_main, "open the catalog")
        self.coll = coll
        self.max_pending = config.max_pending_uploads
        self.tracker = Tracker(session.catalog if coll.is_main else None, remote.name)
        self.tier = self._open_tier(config, remote.name, remote.storage_run, coll)
        self.store = self.tier.store
        self.uploader = self.uploader_class(
            coll,
            self.tier,
            remote,
            tracker=self.tracker,
            attempt=session.attempt_for_save,
            retain=session.retain,
            num_to_keep=session.retention.num_to_keep,
            keep_every_steps=session.retention.keep_every_steps,
            dedup=config.dedup,
            **self._uploader_options(),
        )

    #: the uploader of this tier's checkpoints to save_dir
    uploader_class: type[Uploader] = Uploader
    #: the tier's own copy is plain files; with ``dedup`` the uploader stores the shards in
    #: save_dir as chunks (docs/dedup.md, "Layout", the tiers)
    chunks_in_save = False

    def _open_tier(
        self, config: TierConfig, name: str, run: str | None, coll: Collectives
    ) -> LocalTier:
        """The tier's store (collective): ``local_dir`` of this node."""
        assert config.local_dir is not None
        return LocalTier(config.local_dir, name, run, coll, config.local_num_to_keep)

    def _uploader_options(self) -> dict[str, Any]:
        """More keyword arguments for ``uploader_class`` (a subclass's own collaborators)."""
        return {}

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

    def committed(self, save: Save, timings: dict[str, float], started: float) -> None:
        """Rank 0, after the local marker: record the local replica, queue the upload (rank 0
        uploads the files no other rank reports)."""
        timings["local_s"] = time.monotonic() - started
        manifest = save.committed()
        self.tracker.committed(save.step, LOCAL, manifest, {"local_s": timings["local_s"]})
        writer = save.writer
        job = UploadJob(save.step, writer.payload_path, [], timings, started, writer.save_id)
        self.uploader.submit(job)

    def handed_in(
        self,
        step: int,
        writer: CheckpointWriter | None,
        timings: dict[str, float],
        started: float,
    ) -> None:
        """Every other rank: queue the upload of the files it wrote. Its uploader waits in the
        upload's first collective for rank 0, which queues the step once the local marker is
        committed (or a void job if it never is)."""
        timings["local_s"] = time.monotonic() - started
        own = list(writer.entries) if writer is not None else []
        payload = writer.payload_path if writer is not None else ""
        save_id = writer.save_id if writer is not None else ""
        self.uploader.submit(UploadJob(step, payload, own, timings, started, save_id))

    def failed(self, save: Save, exc: BaseException) -> None:
        """Rank 0: the local save failed: its files and row, and its replica row."""
        save.failed(exc)
        self.tracker.failed(save.step, LOCAL, save.save_id, f"{type(exc).__name__}: {exc}")

    def void(self, save: Save, started: float) -> None:
        """Rank 0: the other ranks queued their part of a save that failed: a void job keeps
        every rank's uploader in step (nothing is uploaded)."""
        job = UploadJob(save.step, "", [], {}, started, save.save_id, void=True)
        self.uploader.submit(job)

    def committed_then_failed(self, save: Save, started: float) -> None:
        """The local marker is committed: a checkpoint, uploaded like any other."""
        self.committed(save, {}, started)

    def wait(self) -> None:
        """No upload queued or running; every failure not reported yet raised, in one
        exception (``uploader.Uploader.wait_all``)."""
        self.uploader.wait_all()

    def backlog(self) -> tuple[int, float]:
        """Uploads pending on this rank (queued, running, failed to retry) and the age of the
        oldest (``Uploader.backlog``)."""
        return self.uploader.backlog()

    def close(self) -> None:
        """Stop the uploader (after its queue), release the local store."""
        self.uploader.close()
        self.tier.close()

    # -- resuming ----------------------------------------------------------------------------

    def resume_candidate(self) -> int | None:
        """Collective: the local tier's newest checkpoint, if every rank holds it in full in
        its own local_dir (else None: save_dir is loaded). Whether the run's history admits
        it is judged when the resume point is chosen (``prefers``)."""
        step = self.coll.from_main(self.tier.newest, "look at the local tier")
        if step is None or not all(self.coll.all_gather(self.tier.holds(step))):
            return None
        return step

    def prefers(self, candidate: int | None, lineage: Lineage, remote: int | None) -> bool:
        """Rank 0: whether the local ``candidate`` (every rank holds it) is still the local
        tier's newest under ``lineage`` and at least save_dir's latest ``remote``."""
        return self.tier.resumable(candidate, lineage, remote)

    def damaged(self, step: int, why: str) -> None:
        """Rank 0: the local copy of ``step`` failed verification: condemned there only."""
        self.tier.condemn(step, why)

    def persist_resumed(self, step: int) -> None:
        """Every rank: queue the upload of the local checkpoint resumed from, newer than
        save_dir's latest (rank 0 holds every file of it and uploads them all)."""
        self.uploader.submit(UploadJob(step, "", [], {}, time.monotonic()))
