"""The memory tier's destination (docs/tiers.md, "The memory tier"): a save commits into host
memory on every node and returns; in the background each rank copies its part to the peer
nodes, then uploads it to ``save_dir``; a resume reads the fastest verified copy.

It is the tiered destination (``local.destination.TieredDestination``: backpressure, the
uploader in step order, retries, fencing, retention per tier) over the memory directories
(``tier.MemoryTier``), with the peer copies made by the uploader before each upload
(``MemoryUploader``) and the resume assembled across nodes (``assembly``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from zephon.collectives import Collectives
from zephon.destinations.local.config import TierConfig
from zephon.destinations.local.destination import TieredDestination
from zephon.destinations.local.tracking import MEMORY
from zephon.destinations.local.upload_protocol import UploadJob, failure_reason, first_line
from zephon.destinations.local.uploader import Uploader
from zephon.destinations.memory.assembly import assemble, fetch_reads
from zephon.destinations.memory.records import record_name
from zephon.destinations.memory.tier import MemoryTier
from zephon.errors import CopyUnavailableError
from zephon.saving import Save
from zephon.storage import CheckpointStore, CheckpointWriter, Lineage, crc32c_of

__all__ = ["MemoryDestination", "MemoryUploader"]

log = logging.getLogger("zephon")


class MemoryUploader(Uploader):
    """The tier's uploader, which first copies each rank's part of a save to the peer nodes."""

    tier: MemoryTier

    def _replicate(self, job: UploadJob, everything: list[Any]) -> None:
        """Every rank: its files of ``job``'s save, its record (and on rank 0 the marker) to
        each peer node of its own; then one all-gather tells rank 0 what reached where, for
        the catalog. A peer that cannot be reached is one warning; save_dir's upload goes
        on."""
        began = time.monotonic()
        nodes = self.tier.nodes
        status: tuple[str | None, int] | None = None
        if job.local_payload and nodes.replicas:
            try:
                status = (None, self._push(job, everything))
            except Exception as exc:  # noqa: BLE001 - a copy failed; the upload goes on
                status = (first_line(failure_reason(exc)), 0)
        statuses = self.exchange.all_gather(status)
        if self.is_main and job.local_payload:
            self._record_copies(job, statuses, time.monotonic() - began)

    def _push(self, job: UploadJob, everything: list[Any]) -> int:
        """This rank's files to its node's peers; returns the bytes sent to each."""
        tier, nodes = self.tier, self.tier.nodes
        payload = job.local_payload
        if self.is_main:
            # its own files: the marker's (its node's) that no other rank reports
            others = {entry["name"] for entries in everything[1:] for entry in entries}
            manifest = tier.manifest(job.step)
            files = [entry for entry in manifest.files if entry.name not in others]
        else:
            files = list(job.own)
        record = os.path.join(payload, record_name(self.rank))
        with open(record, "rb") as source:
            record_bytes = source.read()
        marker: bytes | None = None
        if self.is_main:
            with open(tier.marker_file(job.step), "rb") as source:
                marker = source.read()
        sent = 0
        for peer in nodes.peers_of(nodes.node):
            client = nodes.client(peer)
            try:
                for entry in files:
                    path = os.path.join(payload, *entry.name.split("/"))
                    client.put_file(path, tier.relative(path), entry.crc32c, entry.size)
                client.put_bytes(record_bytes, tier.relative(record), crc32c_of(record_bytes))
                if marker is not None:  # last: the copy is complete once the marker is there
                    where = tier.relative(tier.marker_file(job.step))
                    client.put_bytes(marker, where, crc32c_of(marker))
            except Exception:
                nodes.drop(peer)
                raise
            sent += sum(entry.size for entry in files)
        return sent

    def _record_copies(
        self, job: UploadJob, statuses: list[tuple[str | None, int] | None], elapsed: float
    ) -> None:
        """Rank 0: each node's memory row committed (its part and the copies it received) or
        failed (a copy that did not reach it), and one warning per failed step."""
        nodes, tracker = self.tier.nodes, self.tracker
        failed = {
            rank: status[0]
            for rank, status in enumerate(statuses)
            if status is not None and status[0] is not None
        }
        if failed:
            rank, text = next(iter(failed.items()))
            log.warning(
                "zephon: the peer copy of step %d from rank %d failed (%s); the step stays in "
                "this node's memory and is uploaded to save_dir",
                job.step,
                rank,
                text,
            )
        if tracker is None:
            return
        try:
            manifest = self.tier.manifest(job.step)
        except Exception:  # noqa: BLE001 - a record only
            return
        broken = {peer for rank in failed for peer in nodes.peers_of(nodes.node_of[rank])}
        for node, label in enumerate(nodes.labels):
            if node == nodes.node_of[0]:
                continue  # committed with the save itself
            if node in broken:
                tracker.failed(
                    job.step, MEMORY, manifest.save_id, "a peer copy did not arrive", host=label
                )
            else:
                tracker.committed(
                    job.step, MEMORY, manifest, {"replicate_s": elapsed}, host=label, size=0
                )


class MemoryDestination(TieredDestination):
    """Saves that commit into host memory, copied to peer nodes and uploaded to ``save_dir``
    in the background (construct on every rank at the same point)."""

    uploader_class = MemoryUploader
    tier: MemoryTier

    def _open_tier(
        self, config: TierConfig, name: str, run: str | None, coll: Collectives
    ) -> MemoryTier:
        assert config.memory_dir is not None
        return MemoryTier(
            config.memory_dir,
            name,
            run,
            coll,
            config.memory_num_to_keep,
            config.memory_replicas,
        )

    # -- saving ------------------------------------------------------------------------------

    def committed(self, save: Save, timings: dict[str, float], started: float) -> None:
        """Rank 0, after the memory marker: its record, its node's row, the copies and the
        upload queued."""
        writer = save.writer
        self.tier.record(save.step, save.save_id, writer.payload_path, [])
        timings["memory_s"] = time.monotonic() - started
        manifest = save.committed()
        label = self.tier.nodes.labels[self.tier.nodes.node]
        self.tracker.committed(
            save.step, MEMORY, manifest, {"memory_s": timings["memory_s"]}, host=label
        )
        timings["local_s"] = timings["memory_s"]
        job = UploadJob(save.step, writer.payload_path, [], timings, started, writer.save_id)
        self.uploader.submit(job)

    def handed_in(
        self,
        step: int,
        writer: CheckpointWriter | None,
        timings: dict[str, float],
        started: float,
    ) -> None:
        """Every other rank: its record beside its files, then its part queued."""
        if writer is not None:
            self.tier.record(step, writer.save_id, writer.payload_path, writer.entries)
        super().handed_in(step, writer, timings, started)

    def failed(self, save: Save, exc: BaseException) -> None:
        save.failed(exc)
        label = self.tier.nodes.labels[self.tier.nodes.node]
        reason = f"{type(exc).__name__}: {exc}"
        self.tracker.failed(save.step, MEMORY, save.save_id, reason, host=label)

    # -- resuming ----------------------------------------------------------------------------

    def resume_candidate(self) -> int | None:
        """Collective: the newest memory save the nodes hold in full between them, assembled
        on every node (own memory linked, the small files fetched from peers; the shard files
        its ranks read come with ``fetch_reads``); None: save_dir."""
        return assemble(self.tier, self.coll)

    def fetch_reads(self, step: int, reads: Mapping[str, Sequence[tuple[int, int]]] | None) -> None:
        """Collective: what each node's ranks read of the assembled save and the node does
        not hold, from its peers (``assembly.fetch_reads``)."""
        resumed = self.tier.resumed
        if resumed is not None and resumed.step == step:
            fetch_reads(self.tier, self.coll, reads)

    def persist_resumed(self, step: int) -> None:
        """Every rank: rank 0's node first brings the rest of the assembled save (the upload
        reads all of it there), then the upload is queued. If it cannot, the job goes on
        from what it loaded and its next save is uploaded as usual."""
        try:
            self.fetch_reads(step, None if self.coll.is_main else {})
        except CopyUnavailableError as exc:  # every rank alike
            if self.coll.is_main:
                log.warning("zephon: step %d is not uploaded to save_dir: %s", step, exc)
            return
        super().persist_resumed(step)

    def prefers(self, candidate: int | None, lineage: Lineage, remote: int | None) -> bool:
        """Rank 0: the assembled save, if the run's lineage admits it (never a stale
        attempt's) and save_dir's latest is not newer."""
        if candidate is None or (remote is not None and remote > candidate):
            return False
        return self.tier.admits(lineage)

    def checkpoint_url(self, step: int) -> str:
        return self.tier.resume_url(step)

    @property
    def resume_store(self) -> CheckpointStore:
        return self.tier.resume_store or self.tier.store

    def resumed(self, step: int | None) -> None:
        """Every rank: host memory keeps only the save resumed from, if it came from memory
        (what an earlier job left is never loaded again)."""
        held = self.tier.resumed
        keep = step if held is not None and held.step == step else None
        self.tier.delete_all_but(keep, self.tracker)
