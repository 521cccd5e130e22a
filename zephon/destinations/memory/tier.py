"""The memory tier's store: each node's memory directory, where a save commits first, the
peer copies of other nodes' parts, and the resume that assembles a save from the fastest
copies (docs/tiers.md, "The memory tier").

It is the local tier's store (``local.tier.LocalTier``: the same layout, marker, fence and
retention, a directory per node) with what host memory adds:

- every rank writes a record of its own files beside them (``records``), so a save's
  completeness can be judged across nodes;
- a memory checkpoint's rows in the catalog are one per node (tier ``memory``), the node's
  own part and the peer copies it holds;
- deletes reach every node's directory, marker or not (a node other than rank 0's holds its
  part of a save without a marker);
- a resume assembles the chosen save on every node (``assembly``) into ``<memory_dir>/.resume``:
  files the node holds are linked (no copy), the others its ranks read fetched from the peer
  that holds them, each checked against its CRC32C as it arrives; the loader then reads that
  store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterable
from typing import TYPE_CHECKING

from zephon.attempts import Attempt
from zephon.collectives import Collectives
from zephon.destinations.local.tier import LocalTier
from zephon.destinations.local.tracking import MEMORY, Tracker
from zephon.destinations.memory.choice import Candidate
from zephon.destinations.memory.peers import Nodes
from zephon.destinations.memory.records import write_record
from zephon.saving import Save
from zephon.storage import CheckpointStore, FileEntry, Lineage, Manifest, StorageError

if TYPE_CHECKING:
    from zephon.destinations.memory.assembly import Assembly

__all__ = ["RESUME_DIR", "MemoryTier"]

log = logging.getLogger("zephon")

#: the directory under ``memory_dir`` where a resume assembles the save it loads
RESUME_DIR = ".resume"


class MemoryTier(LocalTier):
    """The memory directories of one run (construct on every rank at the same point)."""

    def __init__(
        self,
        memory_dir: str,
        name: str,
        run: str | None,
        coll: Collectives,
        keep: int,
        replicas: int,
    ) -> None:
        os.makedirs(memory_dir, exist_ok=True)
        super().__init__(memory_dir, name, run, coll, keep)
        self.memory_dir = memory_dir
        self.world_size = coll.world_size
        self.nodes = Nodes(coll, memory_dir, replicas)
        self.resume_root = os.path.join(memory_dir, RESUME_DIR)
        #: the save a resume assembled (and the store it is in), until the job closes
        self.resumed: Candidate | None = None
        self.resume_store: CheckpointStore | None = None
        #: a node leader: how far its assembled store of ``resumed`` is (``assembly``)
        self.assembly: Assembly | None = None
        #: rank 0: a copy a resume loaded from the tier behind memory (the local tier), its
        #: manifest and payload path: what the upload of that step reads
        self.loaded: tuple[Manifest, str] | None = None
        if self.nodes.leader:  # a resume's assembly of an earlier job: never read again
            shutil.rmtree(self.resume_root, ignore_errors=True)

    # -- saving ------------------------------------------------------------------------------

    def begin(self, attempt: Attempt, step: int, tracker: Tracker | None) -> Save:
        """Rank 0: begin the memory save of ``step``; one pending ``memory`` row per node."""
        save = Save.begin(self.attempt(attempt), step, catalog=None)
        self.hold_present_only(save.writer)
        if tracker is not None:
            for label in self.nodes.labels:
                tracker.started(step, MEMORY, self.checkpoint_url(step), save.save_id, host=label)
        return save

    def record(self, step: int, save_id: str, payload: str, files: Iterable[FileEntry]) -> str:
        """This rank's record of its own files of a save (in its payload directory)."""
        return write_record(
            payload,
            rank=self.rank,
            world_size=self.world_size,
            step=step,
            save_id=save_id,
            files=files,
        )

    def relative(self, path: str) -> str:
        """``path`` (in this node's memory directory) relative to it: the name a peer's server
        knows it by."""
        return os.path.relpath(path, os.path.realpath(self.memory_dir)).replace(os.sep, "/")

    def marker_file(self, step: int) -> str:
        """The path of ``step``'s marker in this node's memory directory."""
        return f"{self.store.run(self.run).checkpoint_path(step)}/_COMMIT"

    # -- retention ---------------------------------------------------------------------------

    def delete(self, steps: list[int], tracker: Tracker | None) -> None:
        """Every node's leader deletes these steps' directories in its memory directory, with
        or without a marker (a node's part of a save, a peer copy); rank 0 records each
        node's copy deleted."""
        if not steps:
            return
        if self.nodes.leader:
            run_path = self.store.run(self.run).run_path()
            for step in steps:
                _remove_step(os.path.join(run_path, f"save-{step}"))
        if tracker is not None:
            for step in steps:
                for label in self.nodes.labels:
                    tracker.deleted(step, MEMORY, host=label)

    def delete_all_but(self, keep: int | None, tracker: Tracker | None) -> None:
        """Every node's leader, once the job resumed: delete every memory step but ``keep``
        (the save it resumed from, if it came from memory): what an earlier job left is never
        loaded again, and host memory holds only what this job keeps. Rank 0 records the
        steps it deleted as deleted on every node."""
        if not self.nodes.leader:
            return
        run_path = self.store.run(self.run).run_path()
        gone: list[int] = []
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(run_path):
                if name.startswith("save-") and name != f"save-{keep}":
                    _remove_step(os.path.join(run_path, name))
                    with contextlib.suppress(ValueError):
                        gone.append(int(name[len("save-") :]))
        if tracker is not None:
            for step in sorted(gone):
                for label in self.nodes.labels:
                    tracker.deleted(step, MEMORY, host=label)

    # -- the save a resume assembled -----------------------------------------------------------

    def manifest(self, step: int) -> Manifest:
        if self.loaded is not None and self.loaded[0].step == step:
            return self.loaded[0]
        if self.resumed is not None and self.resume_store is not None and step == self.resumed.step:
            return self.resume_store.run(self.run).read_manifest(step)
        return super().manifest(step)

    def payload_path(self, manifest: Manifest) -> str:
        if self.loaded is not None and self.loaded[0] == manifest:
            return self.loaded[1]
        if (
            self.resumed is not None
            and self.resume_store is not None
            and manifest.step == self.resumed.step
            and manifest.save_id == self.resumed.save_id
        ):
            run = self.resume_store.run(self.run)
            return f"{run.checkpoint_path(manifest.step)}/{manifest.payload}"
        return super().payload_path(manifest)

    def resume_url(self, step: int) -> str:
        """The URL of this tier's copy of ``step``: the assembled store's for the save a
        resume assembled, else this node's memory directory's."""
        if self.resume_store is not None and self.resumed is not None and self.resumed.step == step:
            return self.resume_store.run(self.run).checkpoint_url(step)
        return self.checkpoint_url(step)

    def admits(self, lineage: Lineage) -> bool:
        """Rank 0: whether the run's ``lineage`` admits the assembled save (a stale attempt's
        memory copy is never loaded)."""
        resumed = self.resumed
        if resumed is None:
            return False
        return lineage.admits(resumed.manifest.epoch, resumed.manifest.step)

    def condemn(self, step: int, reason: str) -> None:
        """Rank 0: the assembled copy of ``step`` failed verification: its own node's copy is
        condemned (if it has one), the assembled store forgotten, save_dir used instead."""
        with contextlib.suppress(StorageError):
            manifest = self.store.run(self.run).read_manifest(step)
            self.store.run(self.run).condemn(step, manifest, reason[:2000])
        log.warning(
            "zephon: the memory copy of step %d is damaged (%s); save_dir is used instead",
            step,
            reason.splitlines()[0][:300] if reason else "",
        )

    def close(self) -> None:
        """Stop serving; the assembled store goes (the node's own memory checkpoints stay)."""
        self.nodes.close()
        if self.resume_store is not None:
            self.resume_store.close()
        if self.nodes.leader:
            shutil.rmtree(self.resume_root, ignore_errors=True)
        super().close()


def _remove_step(path: str) -> None:
    """A step directory of a memory directory, its marker first (a marker never names files
    that are already gone, even if the removal stops half-way)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, "_COMMIT"))
    shutil.rmtree(path, ignore_errors=True)
