"""``RunStore``: one run of a ``CheckpointStore`` (``store.run(name)``), the handle every
per-run operation goes through: attempts and fencing, writers and readers of its checkpoints,
latest, verify, delete.

``name=None`` is the inference layout (``<root>/save-<step>/``). A handle is cheap (its store,
its ``RunLayout``) and safe to share between threads as its store is.

The handle composes the modules that act on a run, giving each plain values: the location
(its backend), the run's ``RunLayout`` and, where they check it, the attempt's ``Fence``.
None of them holds or imports the store, so ``store -> run store -> satellites`` has no
circle (tests/test_layers.py checks it).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from zephon.storage.backend import file_exists, make_dirs
from zephon.storage.chunk_sweep import ChunkSweep, sweep_chunks
from zephon.storage.deletion import delete_checkpoints
from zephon.storage.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
    InvalidArgumentError,
)
from zephon.storage.existing import (
    UNREAD,
    check_fence,
    condemn,
    is_condemned,
    settle_existing,
    stale_error,
    supersede,
)
from zephon.storage.layout import RunLayout, validate_run, validate_step
from zephon.storage.leftovers import condemned_saves, remove_condemned
from zephon.storage.lineage import (
    AttemptRecord,
    Fence,
    Lineage,
    claim_attempt,
    decide_resume,
    read_lineage,
    read_records,
)
from zephon.storage.location import Location
from zephon.storage.manifest import Manifest, validate_save_id
from zephon.storage.markers import describe_commit, judge, marker_bytes, parse_marker, read_manifest
from zephon.storage.parallel import concurrently
from zephon.storage.reader import CheckpointReader
from zephon.storage.scan import StepListing, scan_steps
from zephon.storage.verify import VerifyReport, verify_checkpoint
from zephon.storage.writer import CheckpointWriter

__all__ = ["RunStore", "new_save_id"]

#: how often ``begin`` supersedes a marker that keeps reappearing before it gives up
_SUPERSEDE_TRIES = 5


def new_save_id(fence: Fence | None = None) -> str:
    """A fresh save id: ``e<epoch>-<16 hex>`` (the epoch shows in the payload directory)."""
    return f"e{fence.epoch if fence is not None else 0}-{uuid.uuid4().hex[:16]}"


class SharedByRuns(Protocol):
    """What the runs of one store share: what ``CheckpointStore`` offers its ``RunStore``s
    (named here so that this module need not import the store)."""

    location: Location
    part_size: int

    @property
    def url(self) -> str: ...

    def executor(self) -> ThreadPoolExecutor: ...

    def sweep_chunks(
        self,
        *,
        older_than_s: float,
        finished: Collection[str] = (),
        live: Callable[[], Collection[str]] | None = None,
    ) -> ChunkSweep: ...


class RunStore:
    """One run of a ``CheckpointStore``: ``<root>/<name>/save-<step>/`` (``name=None``: the
    inference layout ``<root>/save-<step>/``)."""

    def __init__(self, store: SharedByRuns, name: str | None) -> None:
        validate_run(name)
        self.store = store
        self.name = name
        self.location: Location = store.location
        #: the run's paths (``storage.layout.RunLayout``), handed to the modules it composes
        self.layout: RunLayout = self.location.run_layout(name)

    def __repr__(self) -> str:
        return f"RunStore({self.store.url!r}, {self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunStore) and other.store is self.store and other.name == self.name

    def __hash__(self) -> int:
        return hash((id(self.store), self.name))

    # -- layout --------------------------------------------------------------------------------

    def run_path(self) -> str:
        return self.layout.run_path

    def checkpoint_path(self, step: int) -> str:
        return self.layout.checkpoint_path(step)

    def checkpoint_url(self, step: int) -> str:
        """The checkpoint directory's full URL (credentials masked), as printed to users."""
        return self.location.display(self.checkpoint_path(step))

    def marker_path(self, step: int) -> str:
        """The path of the step's commit marker."""
        return self.layout.marker_path(step)

    def lineage(self) -> Lineage:
        """The run's lineage from its newest attempt record: one listing and one read."""
        return read_lineage(self.location, self.run_path())

    def attempts(self) -> list[AttemptRecord]:
        """Every attempt record of the run, oldest first."""
        return read_records(self.location, self.run_path())

    def claim_attempt(
        self,
        *,
        after: Lineage,
        min_epoch: int = 1,
        attempt_id: str | None = None,
    ) -> Fence:
        """Claim the next epoch of ``run`` (after the lineage ``after``, at least
        ``min_epoch``): from now on every older attempt is fenced out. The attempt then chooses
        where it resumes and records it with ``decide_resume`` before it saves.

        Raises ``FencedOutError`` if another attempt claimed after ``after`` was read: read
        the lineage again and retry.
        """
        validate_run(self.name)
        record = claim_attempt(
            self.location,
            self.run_path(),
            self.name,
            after=after,
            min_epoch=min_epoch,
            attempt_id=attempt_id,
        )
        return Fence(record)

    def decide_resume(self, fence: Fence, resumed_from: int | None) -> Fence:
        """Record that the attempt ``fence`` resumes from ``resumed_from`` (None: from
        nothing): older epochs' checkpoints above it leave the history. Returns the fence to
        save with. ``FencedOutError`` if a newer attempt claimed the run meanwhile."""
        validate_run(self.name)
        return Fence(decide_resume(self.location, self.run_path(), fence.record, resumed_from))

    def check_fence(self, fence: Fence) -> None:
        """Raise ``FencedOutError`` naming the current attempt if one newer than ``fence``
        registered (one listing of the run's attempt records)."""
        check_fence(self.location, self.layout, fence)

    def begin(
        self,
        step: int,
        *,
        fence: Fence | None = None,
        metadata: Mapping[str, Any] | None = None,
        save_id: str | None = None,
        recheck: bool = True,
    ) -> CheckpointWriter:
        """Start a save of checkpoint ``(run, step)``; returns the primary writer.

        Its files go to a payload directory of its own (``save-<step>/<save_id>/``), so nothing
        of another save is removed or overwritten. A marker already at the step is judged:

        - a complete checkpoint of the current history: ``CommitConflictError`` (a committed
          step is never overwritten; also when this same attempt committed it);
        - a marker of a newer epoch than ``fence``: ``FencedOutError``;
        - a checkpoint of an abandoned history (an older epoch above the fence's resume point,
          an unregistered epoch), a damaged marker or a condemned save: superseded. Its marker
          is removed (a damaged one kept as a ``_CORRUPT`` record) and the step is free again.

        ``fence`` is the writer's attempt (``claim_attempt``); without one the writer is
        unfenced (epoch 0), which a run that ever had a fenced attempt refuses
        (``FencedOutError``). The fence check (one listing) and the marker probe (one GET)
        go out together, and the marker is acted on only once the fence passed: one round
        trip when the step is free. ``recheck=False`` skips the fence check here for a caller
        that has just checked the epoch elsewhere (a catalog transaction); the check before
        the marker is never skipped. Call on one process only; other processes ``attach``.

        ``save_id`` (default: a fresh ``new_save_id(fence)``) must be fresh by construction:
        other processes may ``attach`` to it and start writing before this call, so ``begin``
        never lists, removes or overwrites anything in its payload directory. The files of an
        earlier, uncommitted save are gc's to remove (``orphans``), never a new save's.
        """
        validate_run(self.name)
        validate_step(step)
        probe = functools.partial(self.marker_bytes, step)
        if fence is not None:
            if not fence.record.decided:
                raise InvalidArgumentError(
                    f"attempt epoch {fence.epoch} of run {self.name!r} has not decided where it "
                    "resumes: call decide_resume before saving",
                    run=self.name,
                    step=step,
                )
            lineage = fence.lineage
            if recheck:  # a stale attempt learns it before writing, and before superseding
                _, marker = concurrently(functools.partial(self.check_fence, fence), probe)
            else:
                marker = probe()
        else:
            lineage, marker = concurrently(functools.partial(self.lineage), probe)
            if lineage:
                raise stale_error(self.location, self.layout, 0, lineage.current, unfenced=True)
        for _ in range(_SUPERSEDE_TRIES):
            if not settle_existing(self.location, self.layout, step, fence, lineage, marker=marker):
                break
            marker = UNREAD  # superseded: look again, another one may have appeared
        else:
            raise CommitConflictError(
                f"{self.checkpoint_url(step)} kept getting new markers while this save "
                "began; check for several jobs saving this run",
                url=self.checkpoint_url(step),
                run=self.name,
                step=step,
            )
        save_id = validate_save_id(save_id) if save_id is not None else new_save_id(fence)
        writer = self._writer(step, save_id, primary=True, fence=fence, metadata=metadata)
        # Local disk: made durably, so a power loss cannot drop the step directory out
        # from under a committed marker. Object stores have no directories to make.
        make_dirs(self.location, writer.payload_path, durable=True)
        return writer

    def supersede(self, step: int, fence: Fence, *, marker: bytes | None = None) -> None:
        """For a commit that found another save's marker at its step: supersede it if it is
        not part of ``fence``'s history (a stale attempt's marker that slipped in, a damaged
        one), so the commit can be tried again. ``marker`` is its bytes as the commit read
        them (default: read again). Raises like ``begin`` for a valid checkpoint
        (``CommitConflictError``) or a newer attempt (``FencedOutError``)."""
        supersede(self.location, self.layout, step, fence, marker=marker)

    def condemn(self, step: int, manifest: Manifest, reason: str) -> None:
        """Record that the save ``manifest`` describes failed verification: a
        ``_CORRUPT.<save_id>`` record (reason and marker) beside it. From then on no reader
        takes it as latest; it stays for inspection until ``zephon gc --corrupt``. Idempotent;
        nothing is deleted."""
        condemn(self.location, self.layout, step, manifest, reason)

    def is_condemned(self, step: int, save_id: str) -> bool:
        """Whether a ``_CORRUPT`` record condemns save ``save_id`` of the step (one request)."""
        return is_condemned(self.location, self.layout, step, save_id)

    def attach(self, step: int, *, save_id: str, fence: Fence | None = None) -> CheckpointWriter:
        """A secondary writer into a save another process began (e.g. another rank): it
        writes files into the same payload directory and reports entries, but never removes
        anything of others or commits."""
        validate_run(self.name)
        validate_step(step)
        return self._writer(step, save_id, primary=False, fence=fence)

    def _writer(self, step: int, save_id: str, **options: Any) -> CheckpointWriter:
        return CheckpointWriter(
            self.location,
            self.layout,
            step,
            save_id,
            part_size=self.store.part_size,
            executor=self.store.executor,
            **options,
        )

    def is_committed(self, step: int) -> bool:
        """Whether the step's marker exists: one request (or stat). Says nothing about its
        lineage or verification: use ``latest`` to find the checkpoint to resume from."""
        marker = self.marker_path(step)
        location = self.location
        return file_exists(location, marker)

    def list_steps(self, *, detail: bool = False) -> list[StepListing]:
        """Every step directory of a run, committed or not, from one listing."""
        return scan_steps(self.location, self.run_path(), detail=detail)

    def committed_steps(self) -> list[int]:
        """The steps of ``run`` whose marker exists, ascending, from one listing."""
        return [s.step for s in self.list_steps() if s.committed]

    def latest(
        self,
        *,
        lineage: Lineage | None = None,
        on_corrupt: Callable[[int, str], None] | None = None,
    ) -> Manifest | None:
        """The manifest of the newest checkpoint to resume from, by storage alone: its marker
        parses, its save is not condemned, and its epoch and step belong to the current
        lineage. One listing of the steps, one of the attempt records, and one GET per marker
        looked at (newest first); None if the run has none. ``on_corrupt(step, why)`` is told
        of every damaged or condemned marker passed over (it may raise to stop there)."""
        lineage = lineage if lineage is not None else self.lineage()
        for listing in reversed(self.list_steps()):
            if not listing.committed:
                continue
            try:
                manifest = self.read_manifest(listing.step)
            except CheckpointNotFoundError:
                continue  # deleted since the listing
            except CorruptCheckpointError as exc:
                if on_corrupt is not None:
                    on_corrupt(listing.step, str(exc))
                continue
            condemned = manifest.save_id in listing.condemned
            why_not = judge(lineage, manifest, condemned=condemned)
            if why_not is not None:
                if condemned and on_corrupt is not None:
                    on_corrupt(listing.step, why_not)
                continue
            return manifest
        return None

    def latest_step(self) -> int | None:
        """The step of ``latest(run)``, or None."""
        manifest = self.latest()
        return manifest.step if manifest is not None else None

    def complete(self, *, lineage: Lineage | None = None) -> list[Manifest]:
        """Every checkpoint of ``run`` that ``latest`` could answer, ascending by step (what
        retention without a catalog counts). Reads the markers in parallel."""
        lineage = lineage if lineage is not None else self.lineage()
        listings = [s for s in self.list_steps() if s.committed]

        def read(listing: StepListing) -> Manifest | None:
            try:
                manifest = self.read_manifest(listing.step)
            except (CorruptCheckpointError, CheckpointNotFoundError):
                return None
            condemned = manifest.save_id in listing.condemned
            return None if judge(lineage, manifest, condemned=condemned) else manifest

        return [m for m in self.store.executor().map(read, listings) if m is not None]

    def marker_bytes(self, step: int) -> bytes | None:
        """The raw bytes of the step's marker (one GET), or None if there is none."""
        return marker_bytes(self.location, self.layout, step)

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of a committed checkpoint; ``CheckpointNotFoundError`` if there is no
        marker, ``CorruptCheckpointError`` if it does not parse or names another checkpoint."""
        return read_manifest(self.location, self.layout, step)

    def parse_marker(self, step: int, data: bytes) -> Manifest:
        """Validate a marker's bytes as the manifest of ``(run, step)``."""
        return parse_marker(self.location, self.layout, step, data)

    def reader(self, step: int, *, verify: bool = True) -> CheckpointReader:
        """Read access to the committed checkpoint ``(run, step)``; ``verify`` checks every
        whole-file read against the manifest."""
        return CheckpointReader(self.location, self.read_manifest(step), verify=verify)

    def verify(self, step: int, *, deep: bool = False) -> VerifyReport:
        """Check every listed file: exists with its size (shallow), and its CRC32C (deep)."""
        reader = self.reader(step)
        return verify_checkpoint(
            self.location,
            reader.path,
            reader.manifest,
            url=self.checkpoint_url(step),
            deep=deep,
            executor_factory=self.store.executor,
            chunk_dir=self.location.chunk_dir(reader.manifest.chunk_scope, self.name),
        )

    def delete(self, step: int) -> int:
        """Delete a checkpoint: marker first (it stops being complete), then the payload in
        batched requests, then the directory. Idempotent; finishes a delete that crashed.
        Returns the number of payload files removed."""
        return self.delete_many([step])[step]

    def delete_many(self, steps: Iterable[int]) -> dict[int, int]:
        """Delete several checkpoints of one run with as few requests as the backend allows.

        Every marker goes first, in one batched request (none of them is complete any more
        before any payload is touched), then the payload of all of them in batches (S3:
        1,000 keys per DeleteObjects), found with one listing of the run when there are
        several steps. Idempotent. Returns step -> payload files removed.
        """
        return delete_checkpoints(self.location, self.layout, steps)

    def sweep_chunks(
        self,
        *,
        older_than_s: float,
        finished: Collection[str] = (),
        lineage: Lineage | None = None,
        live: Callable[[], Collection[str]] | None = None,
    ) -> ChunkSweep:
        """Remove the run's chunk instances that no marker references and whose save is over
        (fenced out, one of ``finished``, or older than ``older_than_s``, and not one of
        ``live``'s); see ``storage/chunk_sweep.py`` and docs/dedup.md for why this is safe at
        any moment."""
        if self.name is None:  # the inference layout's chunks are the store's
            return self.store.sweep_chunks(older_than_s=older_than_s, finished=finished, live=live)
        lineage = lineage if lineage is not None else self.lineage()
        return sweep_chunks(
            self.location,
            self.layout.chunk_dir,
            [self.layout],
            newest_epoch=lineage.epoch,
            older_than_s=older_than_s,
            finished=finished,
            executor=self.store.executor(),
            live=live,
        )

    def condemned(self) -> list[tuple[int, str]]:
        """``(step, save_id)`` of every save a ``_CORRUPT`` record condemns."""
        return condemned_saves(self.location, self.layout)

    def remove_condemned(self, step: int, save_id: str) -> None:
        """Delete a condemned save (``zephon gc --corrupt``): its marker if it is still the
        step's, its payload directory, then its record."""
        remove_condemned(self.location, self.layout, step, save_id)

    def describe_commit(self, step: int, *, marker: bytes | None = None) -> str:
        """``" (by host pid at time, epoch, save)"`` of the step's marker (``marker``: its
        bytes, already read), for messages about an existing commit ("" if it cannot be
        read)."""
        return describe_commit(self.location, self.layout, step, marker=marker)
