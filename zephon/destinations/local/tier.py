"""The local tier: a node-local directory where a save commits first, before its background
upload to ``save_dir`` (docs/manager.md, "Local tier").

The local directory is a ``CheckpointStore`` of its own with the same layout and marker as
``save_dir``. Its saves carry the attempt's fence; the local store has no attempt records of
its own, so the fence's lineage (read from ``save_dir``) is what judges a marker there, for a
save that finds one at its step and for the resume candidate. Local checkpoints are never in
the ``checkpoints`` catalog table (that is save_dir's); the catalog's replica rows record them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
from collections.abc import Iterable

from zephon.attempts import Attempt
from zephon.collectives import Collectives
from zephon.destinations.local.tracking import LOCAL, Tracker
from zephon.locations import RunLocation
from zephon.saving import Save
from zephon.storage import (
    CheckpointNotFoundError,
    CheckpointStore,
    CheckpointWriter,
    CorruptCheckpointError,
    Fence,
    Lineage,
    Manifest,
    StorageError,
)

__all__ = ["LocalTier"]

log = logging.getLogger("zephon")


class LocalTier:
    """``local_dir`` of one run: begin a local save, retention, the resume candidate.

    Construct on every rank at the same point (it all-gathers hostnames and paths to find the
    one process per local directory that deletes its local checkpoints).
    """

    def __init__(
        self, local_dir: str, name: str, run: str | None, coll: Collectives, keep: int
    ) -> None:
        self.store = CheckpointStore(local_dir, role="local_dir")
        self.location = RunLocation(name, self.store, run)
        self.run = run
        self.keep = keep
        self.rank = coll.rank
        # One process deletes for each local directory: the lowest rank on the same host with
        # the same path (a node's shared local_dir, or a directory of each rank's own).
        place = (socket.gethostname(), os.path.realpath(local_dir))
        places = coll.all_gather(place)
        #: this process deletes the local checkpoints of its local directory
        self.node_leader = places.index(place) == coll.rank
        #: every rank writes into the same directory (one node); else each local marker lists
        #: only the files on its own disk, and only save_dir ever holds the whole checkpoint
        self.shared = all(other == places[0] for other in places)

    def attempt(self, attempt: Attempt) -> Attempt:
        """The same attempt (same fence) saving into the local store."""
        return dataclasses.replace(attempt, location=self.location)

    def begin(self, attempt: Attempt, step: int, tracker: Tracker | None) -> Save:
        """Rank 0: begin the local save of ``step``: no ``checkpoints`` row (that table is
        save_dir's), a local replica row instead."""
        save = Save.begin(self.attempt(attempt), step, catalog=None)
        self.hold_present_only(save.writer)
        if tracker is not None:
            tracker.started(step, LOCAL, self.checkpoint_url(step), save.save_id)
        return save

    def hold_present_only(self, writer: CheckpointWriter) -> None:
        """Rank 0, local directories not shared: the local marker lists the files on this
        disk only (the commit checks that every listed file is there); the other directories'
        ranks hand their entries to the upload instead."""
        if not self.shared:
            writer.keep_present_only()

    def payload_path(self, manifest: Manifest) -> str:
        return f"{self.store.run(self.run).checkpoint_path(manifest.step)}/{manifest.payload}"

    def manifest(self, step: int) -> Manifest:
        return self.store.run(self.run).read_manifest(step)

    def checkpoint_url(self, step: int) -> str:
        return self.store.run(self.run).checkpoint_url(step)

    # -- retention ---------------------------------------------------------------------------

    def doomed(self, protected: Iterable[int], fence: Fence) -> list[int]:
        """Rank 0: the local checkpoints to delete. Kept: the newest ``keep`` of the history
        of ``fence``'s lineage, the ``protected`` ones (their upload has not committed and was
        not refused for good), and any written by a newer attempt (a stale attempt never
        touches its successor's). A checkpoint of an abandoned history goes whatever its step,
        so a stale attempt's late local save never crowds out the current one's."""
        keepers = set(protected)
        history: list[int] = []
        junk: list[int] = []
        for step in self.store.run(self.run).committed_steps():
            try:
                manifest = self.store.run(self.run).read_manifest(step)
            except CheckpointNotFoundError:
                continue
            except CorruptCheckpointError:
                junk.append(step)  # a damaged local marker is never loaded nor uploaded
                continue
            if manifest.epoch > fence.epoch:
                continue
            if fence.lineage.admits(manifest.epoch, manifest.step):
                history.append(step)
            else:
                junk.append(step)
        newest = set(sorted(history)[-self.keep :])
        return sorted(s for s in history + junk if s not in keepers and s not in newest)

    def delete(self, steps: list[int], tracker: Tracker | None) -> None:
        """Node leaders: delete these local checkpoints (idempotent, marker first). A failure
        is one warning: the next retention tries again."""
        if not steps or not self.node_leader:
            return
        try:
            self.store.run(self.run).delete_many(steps)
        except StorageError as exc:
            log.warning("zephon: could not delete local checkpoints %s: %s", steps, exc)
            return
        if tracker is not None:
            for step in steps:
                tracker.deleted(step, LOCAL)

    # -- resume ------------------------------------------------------------------------------

    def candidate(self, lineage: Lineage) -> Manifest | None:
        """Rank 0: the newest local checkpoint the run's lineage admits (cheap on local disk)."""
        try:
            return self.store.run(self.run).latest(lineage=lineage)
        except StorageError as exc:
            log.warning("zephon: the local tier %s cannot be read: %s", self.store.url, exc)
            return None

    def resumable(self, candidate: int | None, lineage: Lineage, remote: int | None) -> bool:
        """Rank 0: whether the local ``candidate`` (every rank holds it) is still this store's
        newest under ``lineage`` and at least save_dir's latest ``remote``."""
        if candidate is None or (remote is not None and remote > candidate):
            return False
        manifest = self.candidate(lineage)
        return manifest is not None and manifest.step == candidate

    def newest(self) -> int | None:
        """Rank 0: the newest local step whose marker parses and is not condemned, judged by
        no lineage yet (local disk only: the resume choice judges it after the claim)."""
        try:
            for listing in reversed(self.store.run(self.run).list_steps()):
                if not listing.committed:
                    continue
                try:
                    manifest = self.store.run(self.run).read_manifest(listing.step)
                except (CheckpointNotFoundError, CorruptCheckpointError):
                    continue
                if manifest.save_id not in listing.condemned:
                    return listing.step
        except StorageError as exc:
            log.warning("zephon: the local tier %s cannot be read: %s", self.store.url, exc)
        return None

    def holds(self, step: int) -> bool:
        """Whether this process's local directory holds ``step`` in full (its marker, every
        file with its size)."""
        try:
            return self.store.run(self.run).verify(step).ok
        except StorageError:
            return False

    def condemn(self, step: int, reason: str) -> None:
        """Rank 0: a local copy found damaged: condemned on the local store only (save_dir's
        copy, if any, is another checkpoint)."""
        with contextlib.suppress(StorageError):
            manifest = self.store.run(self.run).read_manifest(step)
            self.store.run(self.run).condemn(step, manifest, reason[:2000])
        log.warning(
            "zephon: local checkpoint %s is damaged (%s); it is condemned and save_dir is "
            "used instead",
            self.checkpoint_url(step),
            reason.splitlines()[0][:300] if reason else "",
        )

    def close(self) -> None:
        self.store.close()
