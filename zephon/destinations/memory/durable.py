"""The memory tier with ``local_dir`` behind it (docs/memory.md, "A local disk behind memory"):
a save commits into host memory and returns; in the background, for each save in step order,
the peer copies (``MemoryUploader``), then every node's copy into its ``local_dir``
(``local_copy.LocalCopies``), then the upload to ``save_dir``. A resume takes the fastest
verified copy of the current lineage: own memory, a peer's memory, local disk, save_dir.

Chosen once, by ``choose_destination``, for a config with both ``memory_tier`` and
``local_dir``; the memory tier alone stays ``destination.MemoryDestination``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zephon.collectives import Collectives
from zephon.destinations.local.config import TierConfig
from zephon.destinations.local.tier import LocalTier
from zephon.destinations.local.tracking import LOCAL
from zephon.destinations.local.upload_protocol import UploadJob, failure_reason, first_line
from zephon.destinations.memory.destination import MemoryDestination, MemoryUploader
from zephon.destinations.memory.local_copy import CopyOutcome, LocalCopies
from zephon.destinations.memory.tier import MemoryTier
from zephon.storage import CheckpointStore, Fence, Lineage, Manifest

if TYPE_CHECKING:
    from zephon.session import RunSession

__all__ = ["DurableMemoryDestination", "DurableMemoryUploader"]

log = logging.getLogger("zephon")

#: where a resume's candidate is
_MEMORY = "memory"
_LOCAL = "local"


@dataclass
class _LocalOrder:
    """Rank 0's word to every node: copy this memory save under this fence."""

    manifest: Manifest
    fence: Fence
    #: steps whose upload has not committed: local retention keeps them
    protected: set[int]


class DurableMemoryUploader(MemoryUploader):
    """The memory tier's uploader, which copies each save into ``local_dir`` after the peer
    copies and before the upload."""

    def __init__(self, *args: Any, local: LocalCopies, **kwargs: Any) -> None:
        self.copies = local  # before the thread starts
        super().__init__(*args, **kwargs)

    def _replicate(self, job: UploadJob, everything: list[Any]) -> None:
        """Every rank: the peer copies, then the local copies (whatever save_dir answered,
        unless it refused a stale attempt)."""
        super()._replicate(job, everything)
        order = self._local_order(job, everything[0]) if self.is_main else None
        order = self.exchange.broadcast(order)
        if order is None:
            return
        outcome: CopyOutcome | None = None
        if self.copies.local.node_leader:
            outcome = self.copies.copy(order.manifest, order.fence, order.protected)
        outcomes = self.exchange.all_gather(outcome)
        if self.is_main:
            self._record_local(order.manifest, outcomes)

    def _local_order(self, job: UploadJob, head: dict[str, Any]) -> _LocalOrder | None:
        """Rank 0: what every node copies (None: nothing, for a job that made no memory save
        or an attempt that is stale, whose copy would never be loaded)."""
        if not job.local_payload or head.get("stale"):
            return None
        try:
            fence = head["fence"] if head.get("ok") else self._attempt().fence
            manifest = self.tier.manifest(job.step)
        except Exception as exc:  # noqa: BLE001 - no local copy of this step; the upload goes on
            log.warning(
                "zephon: step %d is not copied to local_dir (%s)",
                job.step,
                first_line(failure_reason(exc)),
            )
            return None
        return _LocalOrder(manifest, fence, self._protected())

    def _record_local(self, manifest: Manifest, outcomes: list[CopyOutcome | None]) -> None:
        """Rank 0: one ``local`` row per node (its label, as the memory rows), committed or
        failed, the steps its retention deleted; one warning if a copy failed."""
        nodes, tracker, step = self.tier.nodes, self.tracker, manifest.step
        failed = [(rank, o.error) for rank, o in enumerate(outcomes) if o is not None and o.error]
        if failed:
            rank, text = failed[0]
            log.warning(
                "zephon: the local_dir copy of step %d on the node of rank %d failed (%s); the "
                "step is still in memory and is uploaded to save_dir",
                step,
                rank,
                text,
            )
        if tracker is None:
            return
        for rank, outcome in enumerate(outcomes):
            if outcome is None:
                continue
            host = nodes.labels[nodes.node_of[rank]]
            tracker.started(step, LOCAL, outcome.url, manifest.save_id, host=host)
            if outcome.error:
                tracker.failed(step, LOCAL, manifest.save_id, outcome.error, host=host)
            else:
                timings = {"local_s": outcome.seconds}
                tracker.committed(step, LOCAL, manifest, timings, host=host, size=outcome.size)
            for gone in outcome.deleted:
                tracker.deleted(gone, LOCAL, host=host)


class DurableMemoryDestination(MemoryDestination):
    """The memory tier with ``local_dir`` behind it (construct on every rank at the same
    point)."""

    uploader_class = DurableMemoryUploader
    copies: LocalCopies

    def __init__(self, session: RunSession, config: TierConfig, coll: Collectives) -> None:
        self.remote = session.location
        #: where the resume candidate is (``_MEMORY``, ``_LOCAL``; None: save_dir)
        self.source: str | None = None
        #: the local copy every rank holds (step, save id), gathered by ``resume_candidate``
        self._local_held: tuple[int, str] | None = None
        self.local_step: int | None = None
        super().__init__(session, config, coll)

    def _open_tier(
        self, config: TierConfig, name: str, run: str | None, coll: Collectives
    ) -> MemoryTier:
        memory = super()._open_tier(config, name, run, coll)
        assert config.local_dir is not None
        local = LocalTier(config.local_dir, name, run, coll, config.local_num_to_keep)
        self.copies = LocalCopies(local, memory)
        return memory

    def _uploader_options(self) -> dict[str, Any]:
        return {"local": self.copies}

    def close(self) -> None:
        super().close()
        self.copies.local.close()

    # -- resuming ----------------------------------------------------------------------------

    def resume_candidate(self) -> int | None:
        """Collective: the memory save the nodes hold between them (assembled), else the
        local copy every rank holds in full, whichever is newer; None: save_dir. A memory
        save the run's lineage no longer admits gives way to a local copy."""
        memory = super().resume_candidate()
        local = self.copies.candidate(self.coll)
        self._local_held = local
        self.source = self._choose(memory, local)
        if self.source == _LOCAL:
            return self._take_local()
        return memory

    def next_candidate(self) -> int | None:
        """Every rank: after the memory copy failed to load, the local copy every rank holds
        (the same answer everywhere: ``resume_candidate`` gathered it); None after that."""
        if self.source == _MEMORY and self._local_held is not None:
            return self._take_local()
        self.source = None
        return None

    def _take_local(self) -> int:
        local = self._local_held
        assert local is not None
        self.source = _LOCAL
        self.local_step = local[0]
        self.tier.resumed = None  # the assembled save, if any, is not the one loaded
        if self.coll.is_main:
            log.info("zephon: step %d is in every rank's local_dir", local[0])
        return local[0]

    def _choose(self, memory: int | None, local: tuple[int, str] | None) -> str | None:
        """Every rank, the same answer: memory unless the local copy is newer, or memory's
        save is another one that the run's lineage (read now on rank 0) does not admit."""
        if local is None:
            return _MEMORY if memory is not None else None
        step, save_id = local
        if memory is None or memory < step:
            return _LOCAL
        resumed = self.tier.resumed
        if memory == step and resumed is not None and resumed.save_id == save_id:
            return _MEMORY
        admitted = self.coll.from_main(self._memory_admitted, "judge the memory copy")
        return _MEMORY if admitted else _LOCAL

    def _memory_admitted(self) -> bool:
        """Rank 0: whether save_dir's lineage admits the assembled memory save (unknown:
        yes, and ``prefers`` judges it again under the attempt's claim)."""
        try:
            lineage = self.remote.runstore.lineage()
        except Exception:  # noqa: BLE001 - judged again once the attempt is claimed
            return True
        return self.tier.admits(lineage)

    def prefers(self, candidate: int | None, lineage: Lineage, remote: int | None) -> bool:
        if self.source == _LOCAL:
            return self.copies.local.resumable(candidate, lineage, remote)
        return super().prefers(candidate, lineage, remote)

    def checkpoint_url(self, step: int) -> str:
        if self.source == _LOCAL and step == self.local_step:
            return self.copies.local.checkpoint_url(step)
        return super().checkpoint_url(step)

    @property
    def resume_store(self) -> CheckpointStore:
        if self.source == _LOCAL:
            return self.copies.local.store
        return super().resume_store

    def damaged(self, step: int, why: str) -> None:
        if self.source == _LOCAL:
            self.copies.local.condemn(step, why)
        else:
            super().damaged(step, why)

    def persist_resumed(self, step: int) -> None:
        """Every rank: the upload of the copy resumed from; a local one is read from rank 0's
        ``local_dir`` (it holds the whole save)."""
        if self.source == _LOCAL and self.coll.is_main:
            self.tier.loaded = self.copies.payload(step)
        super().persist_resumed(step)
