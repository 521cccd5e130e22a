"""``Destination``: the contract between a saving entry point (the checkpoint manager's saver
and loader, ``zephon.dcp.Writer``) and where its saves go (docs/tiers.md, "Destinations").

A save runs the same way whatever the destination:

1. every rank: ``before_save`` (backpressure; a stale attempt or a dead uploader stops here);
2. rank 0: ``begin(attempt, step)`` -> a ``zephon.saving.Save`` (the one fenced save path);
   the other ranks attach to it in ``store`` by its save id;
3. every rank writes its files; rank 0 commits the marker;
4. rank 0: ``committed(save, timings, started)``; every other rank: ``handed_in(step,
   writer, timings, started)``, its part written. On a failure rank 0 calls ``failed(save,
   exc)`` (and ``void`` when the other ranks handed in their part already, as the DCP Writer's
   do); a marker committed before the caller failed (the Writer's ``on_commit``) goes to
   ``committed_then_failed``;
5. ``wait`` waits for background work and raises its failures; ``close`` releases it.

Resuming, the loader asks the destination for a copy of its own (``resume_candidate``,
``prefers``, ``checkpoint_url``, ``store``), condemns a damaged one (``damaged``) and hands
back one newer than save_dir's latest (``persist_resumed``). A destination that holds no copy
of its own (direct) keeps the defaults below.

**A memory tier fits as one more destination**: ``begin`` stages the save in host memory (a
``Save`` over an in-memory ``CheckpointStore``, its replica recorded like the local tier's),
``committed`` queues the copy to save_dir (or to the local tier) on a background thread,
``before_save``/``wait`` bound and drain that queue, and the resume methods offer the
in-memory copy when every rank still holds it. ``choose_destination`` picks it from a config
of its own; the saver, the loader and the Writer do not change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from zephon.storage import CheckpointStore, CheckpointWriter, Lineage

if TYPE_CHECKING:
    from zephon.attempts import Attempt
    from zephon.saving import Save

__all__ = ["Destination"]


class Destination:
    """Where one job's saves go (see the module docstring for the sequence)."""

    #: the store this process writes a save's files into (secondary ranks attach to it)
    store: CheckpointStore
    #: with ``dedup``: whether a save writes its shards as chunks into ``store`` (direct);
    #: a tier keeps plain files and its uploader deduplicates the copy to save_dir
    chunks_in_save: bool = True

    # -- saving ------------------------------------------------------------------------------

    def before_save(self) -> None:
        """Every rank, before a save: wait for room, or raise what stops the job."""

    def begin(self, attempt: Attempt, step: int) -> Save:
        """Rank 0: begin the save of ``step`` under ``attempt`` (fenced)."""
        raise NotImplementedError

    def committed(self, save: Save, timings: dict[str, float], started: float) -> None:
        """Rank 0, after the marker: record the checkpoint (``timings``: the phases measured
        so far; ``started``: ``time.monotonic()`` when the save began)."""
        raise NotImplementedError

    def handed_in(
        self,
        step: int,
        writer: CheckpointWriter | None,
        timings: dict[str, float],
        started: float,
    ) -> None:
        """Every other rank, its part of ``step`` written (``writer``: its secondary writer;
        None if it could not attach). Nothing to do by default."""

    def failed(self, save: Save, exc: BaseException) -> None:
        """Rank 0: the save did not complete: fail it (its files, its row) and record it."""
        save.failed(exc)

    def void(self, save: Save, started: float) -> None:
        """Rank 0, after ``failed``, when the other ranks had handed in their part already:
        keep their background work in step. Nothing to do by default."""

    def committed_then_failed(self, save: Save, started: float) -> None:
        """Rank 0: the marker was committed, then the caller failed (its own hook raised).
        By default nothing: the row stays pending until the catalog is reconciled with
        storage."""

    def wait(self) -> None:
        """Every rank: wait for background work; raise its failures."""

    def close(self) -> None:
        """Every rank: stop background work and release what the destination opened."""

    def backlog(self) -> tuple[int, float]:
        """This rank's copies still to reach save_dir and the oldest one's age in seconds
        (metrics: the tier's lag); ``(0, 0.0)`` for a destination that writes save_dir."""
        return 0, 0.0

    # -- resuming ----------------------------------------------------------------------------

    def resume_candidate(self) -> int | None:
        """Collective: the step of a copy of this destination's own that every rank holds in
        full (None: save_dir is loaded)."""
        return None

    def next_candidate(self) -> int | None:
        """Every rank, after the candidate failed to load (``damaged`` told rank 0): the step
        of the next copy of this destination's own to try, the same on every rank (None:
        save_dir is loaded)."""
        return None

    def prefers(self, candidate: int | None, lineage: Lineage, remote: int | None) -> bool:
        """Rank 0: whether to resume from ``candidate`` rather than save_dir's latest
        ``remote``, judged by the run's ``lineage``."""
        return False

    def checkpoint_url(self, step: int) -> str:
        """The URL of this destination's copy of ``step``."""
        raise NotImplementedError

    @property
    def resume_store(self) -> CheckpointStore:
        """The store a resume from this destination's candidate reads (by default the one
        saves go to; the memory tier's is the save it assembled)."""
        return self.store

    def fetch_reads(self, step: int, reads: Mapping[str, Sequence[tuple[int, int]]] | None) -> None:
        """Collective, every rank, before the resume loads this destination's copy of
        ``step``: ``reads`` maps the shard files this rank reads to the byte ranges
        ``(offset, length)`` it reads of each (None: every file whole). A copy that is not
        whole in one place brings them here; raises ``CopyUnavailableError``
        (``zephon.errors``) on every rank if it cannot. Nothing to do by default."""

    def resumed(self, step: int | None) -> None:
        """Every rank, once the job resumed from ``step`` (None: a fresh start), wherever it
        was loaded from. Nothing to do by default."""

    def damaged(self, step: int, why: str) -> None:
        """Rank 0: this destination's copy of ``step`` failed verification."""

    def persist_resumed(self, step: int) -> None:
        """Every rank: the job resumed from this destination's copy of ``step``, newer than
        save_dir's latest: bring it to save_dir."""
