"""The local tier behind host memory (docs/memory.md, "A local disk behind memory"): each
node's copy of a memory save into its ``local_dir``, that directory's retention, and its
resume candidate.

A node's local copy is what its memory directory holds of the save (the files its own ranks
wrote and the peer copies it received), copied file by file on the same node (no
re-serialisation), each file checked against its CRC32C as it is copied, then committed like
the local tier's own saves: the same layout and marker (``<local_dir>/<run>/save-<step>/
<save_id>/``, rank 0's metadata, the attempt's fence), the marker listing the files copied.
The local store is the local tier's (``local.tier.LocalTier``): its retention, its condemn
and its resume checks are used as they are.

A copy is loadable on its own only when every rank's ``local_dir`` holds the whole save: one
node, or nodes whose memory held every other node's part (two nodes, one replica each). The
resume checks it: every rank's local marker names the same save and the same files.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

from zephon.collectives import Collectives
from zephon.destinations.local.tier import LocalTier
from zephon.destinations.local.transfer import copy_verified
from zephon.destinations.memory.records import scan
from zephon.destinations.memory.tier import MemoryTier
from zephon.storage import Fence, FileEntry, Manifest, StorageError

__all__ = ["CopyOutcome", "LocalCopies"]

log = logging.getLogger("zephon")


@dataclass
class CopyOutcome:
    """What one node's local copy of a save did (sent to rank 0 for the catalog's rows)."""

    #: the local copy's URL on this node
    url: str
    #: why the copy failed (one line), None if it committed
    error: str | None = None
    #: bytes copied
    size: int = 0
    seconds: float = 0.0
    #: local checkpoints retention deleted after the copy
    deleted: list[int] = field(default_factory=list)


class LocalCopies:
    """This node's ``local_dir`` behind its memory directory ``memory``.

    ``local``: the local tier's store of ``local_dir`` (constructed on every rank at the same
    point: it all-gathers to find one process per local directory, ``local.node_leader``,
    which makes the copies and deletes them).
    """

    def __init__(self, local: LocalTier, memory: MemoryTier) -> None:
        self.local = local
        self.memory = memory

    # -- saving ------------------------------------------------------------------------------

    def copy(self, manifest: Manifest, fence: Fence, protected: set[int]) -> CopyOutcome:
        """A node leader of ``local_dir``: the memory save ``manifest`` (rank 0's memory
        marker) names, as this node holds it, into ``local_dir`` and committed under
        ``fence``; then local retention (the newest ``local_num_to_keep`` of the lineage,
        and the ``protected`` steps, whose upload has not committed). Never raises: a failure
        is the outcome's ``error``, the copy's files removed."""
        began = time.monotonic()
        outcome = CopyOutcome(self.local.checkpoint_url(manifest.step))
        try:
            outcome.size = self._copy(manifest, fence)
        except Exception as exc:  # noqa: BLE001 - one warning and a failed row; the upload goes on
            outcome.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        outcome.seconds = time.monotonic() - began
        outcome.deleted = self._retain(fence, protected)
        return outcome

    def _copy(self, manifest: Manifest, fence: Fence) -> int:
        step = manifest.step
        files = self.held(manifest)
        if not files:
            raise FileNotFoundError(f"this node's memory holds no file of step {step}")
        source = self.memory.payload_path(manifest)
        run = self.local.store.run(self.local.run)
        writer = run.begin(step, fence=fence, save_id=manifest.save_id, metadata=manifest.metadata)
        try:
            copy_verified(files, source, writer)
            writer.commit()
        except BaseException:
            try:
                writer.abort()
            except Exception as exc:  # noqa: BLE001 - the copy's own failure is the one raised
                log.debug("zephon: the local copy of step %d was not removed: %s", step, exc)
            raise
        return sum(entry.size for entry in files)

    def held(self, manifest: Manifest) -> list[FileEntry]:
        """The files of the save ``manifest`` names that this node's memory holds with their
        size, each with its CRC32C: rank 0's marker's entries and every rank's record's."""
        holding = next(
            (
                h
                for h in scan(self.memory.store.run(self.memory.run).run_path())
                if h.step == manifest.step and h.save_id == manifest.save_id
            ),
            None,
        )
        if holding is None:
            return []
        known: dict[str, FileEntry] = {entry.name: entry for entry in manifest.files}
        for record in holding.records.values():
            for data in record["files"]:
                entry = FileEntry(**data)
                known.setdefault(entry.name, entry)
        return [e for name, e in sorted(known.items()) if holding.files.get(name) == e.size]

    def _retain(self, fence: Fence, protected: set[int]) -> list[int]:
        """Delete the local checkpoints local retention drops (``LocalTier.doomed``); the
        steps deleted. A failure is one warning: the next save's retention tries again."""
        try:
            doomed = self.local.doomed(protected, fence)
            if doomed:
                self.local.store.run(self.local.run).delete_many(doomed)
            return doomed
        except Exception as exc:  # noqa: BLE001 - never the uploader's death; tried again
            log.warning("zephon: could not apply local_dir retention: %s", exc)
            return []

    # -- resuming ----------------------------------------------------------------------------

    def candidate(self, coll: Collectives) -> tuple[int, str] | None:
        """Collective: the local tier's newest step and save id if every rank's ``local_dir``
        holds it in full and every rank's marker names the same save and the same files (so
        each holds the whole save); None otherwise. The lineage judges it later
        (``LocalTier.resumable``)."""
        step = coll.from_main(self.local.newest, "look at the local tier")
        mine = self._fingerprint(step) if step is not None else None
        every = coll.all_gather(mine)
        if mine is None or any(other != mine for other in every):
            return None
        assert step is not None
        return step, mine[0]

    def _fingerprint(self, step: int) -> tuple[str, str] | None:
        """This rank's local copy of ``step``: its save id and a digest of the files its marker
        lists (None if it does not hold it in full)."""
        if not self.local.holds(step):
            return None
        try:
            manifest = self.local.manifest(step)
        except StorageError:
            return None
        listed = sorted((e.name, e.size, e.crc32c) for e in manifest.files)
        digest = hashlib.sha256(repr(listed).encode()).hexdigest()
        return manifest.save_id, digest

    def payload(self, step: int) -> tuple[Manifest, str]:
        """The local copy of ``step``: its manifest and payload directory."""
        manifest = self.local.manifest(step)
        return manifest, self.local.payload_path(manifest)
