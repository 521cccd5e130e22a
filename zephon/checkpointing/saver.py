"""The manager's save sequence (docs/manager.md, "Saving"): prepare the state on every rank,
begin the fenced save on rank 0 through the job's destination (``zephon.destinations``:
``zephon.saving.Save`` into save_dir, or into the local tier), write the JSON files and the DCP
shards, commit, then hand the checkpoint to the destination (record it, apply retention or
queue its upload).

Every step is a collective: a failure on any rank raises on every rank, and the save's own
files and catalog row are failed and removed (``Save.failed``), never another save's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zephon import dcp as zdcp
from zephon.checkpointing.background import Background
from zephon.checkpointing.files import (
    DCP_SUBDIR,
    META_FILE,
    META_VERSION,
    capture_rng,
    encode_json,
    rank_file,
)
from zephon.checkpointing.job import Job
from zephon.checkpointing.layout import IN_PLACE, PER_RANK, StateLayout
from zephon.checkpointing.source import parse_checkpoint_url
from zephon.collectives import Collectives
from zephon.errors import ZephonError, as_zephon_error
from zephon.saving import Save
from zephon.state_tree import split_state, tensor_keys
from zephon.storage import CheckpointWriter, FileEntry, Manifest, StorageError

__all__ = ["PreparedState", "Saver"]


@dataclass(frozen=True, slots=True)
class PreparedState:
    """This rank's part of a save, before anything is written."""

    #: what each state entry is (model, optimizer, stateful, value)
    layout: StateLayout
    #: every tensor DCP writes: the shared entries' and this rank's own (under ``rank<r>/``)
    tensors: dict[str, Any]
    #: the JSON skeleton of the shared entries (rank 0 writes it into ``zephon.json``)
    shared: Any
    #: this rank's own document (``ranks/<rank>.json``): its state, RNG and ``rank_state``
    own: dict[str, Any]


class Saver:
    """Saves checkpoints of one ``Job``; async saves commit through ``background``.

    ``coll`` is the process group the saves run on (default: the job's); an emergency save
    made off the main thread (``zephon.emergency_now``) gives groups of its own, so it never
    meets the training loop's collectives. ``asynchronous`` overrides ``async_save``."""

    def __init__(
        self,
        job: Job,
        background: Background,
        *,
        coll: Collectives | None = None,
        asynchronous: bool | None = None,
    ) -> None:
        self.job = job
        self.background = background
        self.coll = coll if coll is not None else job.coll
        self.asynchronous = job.config.async_save if asynchronous is None else asynchronous
        #: rank 0: told of each commit (step, seconds since the save began, bytes): metrics
        self.on_committed: Callable[[int, float, int | None], None] | None = None
        #: rank 0, with ``dedup``: the newest checkpoint committed in save_dir's history as
        #: this process knows it (None until it looked, or committed one)
        self._dedup_base: Manifest | None = None

    def dedup_base(self) -> Manifest | None:
        """Rank 0: the base of the next deduplicated save: the checkpoint this process
        committed last, else the run's latest complete one on storage, else (``dedup_scope:
        save_dir``) the run's ``source_checkpoint`` when it is a checkpoint of the same
        save_dir (docs/dedup.md)."""
        if self._dedup_base is None:
            store = self.job.destination.store
            self._dedup_base = store.run(self.job.run).latest()
            if self._dedup_base is None and self.job.config.dedup_scope == "save_dir":
                self._dedup_base = self._source_base()
        return self._dedup_base

    def _source_base(self) -> Manifest | None:
        """The manifest of ``source_checkpoint`` if it is a checkpoint under save_dir."""
        source = self.job.model_stage.source_checkpoint
        if source is None:
            return None
        try:
            save_dir, run, step = parse_checkpoint_url(source)
        except ZephonError:
            return None  # a safetensors export: nothing to share
        if save_dir.rstrip("/") != self.job.config.save_dir.rstrip("/"):
            return None
        try:
            return self.job.destination.store.run(run).read_manifest(step)
        except StorageError:
            return None

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        rank_state: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None = None,
        *,
        prepared: PreparedState | None = None,
    ):
        """``CheckpointManager.save`` (see there); ``metadata``: more for the marker's (and
        the catalog row's) metadata, e.g. an emergency save's trigger; ``prepared``: this
        rank's part, prepared earlier (a snapshot; ``state`` is then not read)."""
        job, coll = self.job, self.coll
        started = time.monotonic()
        self.background.wait()
        #: the phases of this save, completed as they happen (the catalog row gets them)
        timings: dict[str, float] = {}
        problem: Exception | None = None
        try:
            job.destination.before_save()  # backpressure; a stale attempt stops here
            if prepared is None:
                prepared = self.prepare(state, rank_state)
        except Exception as exc:
            problem = exc
        # Doubles as the barrier before the save.
        coll.agree(problem, f"prepare the state of step {step}")
        assert prepared is not None
        store = job.destination.store
        save: Save | None = None
        primary: CheckpointWriter | None = None
        if coll.is_main:
            try:
                save = job.destination.begin(job.current_attempt(), step)
                primary = save.writer
            except Exception as exc:
                problem = exc
        try:
            writer = zdcp.attach_ranks(store, job.run, step, primary, process_group=coll.group)
        except Exception:
            if problem is not None:
                raise problem from None
            raise
        try:
            self._write_json(writer, step, prepared)
            storage_writer = zdcp.ZephonStorageWriter(
                writer,
                subdir=DCP_SUBDIR,
                commit_metadata={**(metadata or {}), "step": step, "kind": job.kind},
                dedup_base=self.dedup_base
                if job.config.dedup and job.destination.chunks_in_save
                else None,
                dedup_scope=job.config.dedup_scope,
            )
            if self.asynchronous:
                staging = time.monotonic()
                future = zdcp.async_save(
                    prepared.tensors,
                    storage_writer,
                    process_group=coll.io_group,
                    stager=self.background.stager(),
                )
                timings["stage_s"] = time.monotonic() - staging
                returned = threading.Event()  # the commit records stall_s, known once we return
                self.background.start(
                    step,
                    future,
                    returned,
                    commit=lambda: self._committed(step, save, writer, timings, started),
                    fail=lambda exc: self._failed(writer, save, exc),
                )
                try:
                    coll.barrier()
                    timings["stall_s"] = time.monotonic() - started
                finally:
                    returned.set()
                return
            zdcp.save(prepared.tensors, storage_writer, process_group=coll.io_group)
        except BaseException as exc:
            self._failed(writer, save, exc)
            translated = as_zephon_error(exc)
            if translated is not exc:  # the commit met a newer attempt
                raise translated from exc
            raise
        timings["stall_s"] = time.monotonic() - started
        self._committed(step, save, writer, timings, started)
        coll.barrier()

    def prepare(
        self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None
    ) -> PreparedState:
        """This rank's part of a save, before anything is written: classify the state, split
        tensors from JSON, and build this rank's own JSON document."""
        job = self.job
        layout = StateLayout(
            state, trainable_only=job.model_stage.checkpoint_only_trainable_parameters
        )
        # Models and optimizers are shared by all ranks (DCP reshards them); every other entry
        # is this rank's own, its tensors keyed under rank<r>/ so DCP keeps every rank's copy.
        tensors, shared = split_state(layout.state_tree(IN_PLACE))
        own_tensors, own = split_state(layout.state_tree(PER_RANK), (f"rank{self.coll.rank}",))
        tensors.update(own_tensors)
        document: dict[str, Any] = {"state": own}
        if job.save_rng:
            document["rng"] = capture_rng()
        if rank_state is not None:
            _, rank_skeleton = split_state(dict(rank_state))
            if tensor_keys(rank_skeleton):
                raise ZephonError("rank_state holds tensors: keep per-rank state to JSON values")
            document["rank_state"] = rank_skeleton
        return PreparedState(layout=layout, tensors=tensors, shared=shared, own=document)

    def _write_json(self, writer: CheckpointWriter, step: int, prepared: PreparedState) -> None:
        """Every rank writes ``ranks/<rank>.json`` (rank 0 also ``zephon.json``); rank 0 then
        records every rank's file in the manifest."""
        job, coll = self.job, self.coll
        entry, problem = None, None
        try:
            entry = writer.write_bytes(rank_file(coll.rank), encode_json(prepared.own))
            if coll.is_main:
                meta = {
                    "format_version": META_VERSION,
                    "run": job.run,
                    "name": job.name,
                    "kind": job.kind,
                    "step": step,
                    "total_steps": job.total_steps,
                    "world_size": coll.world_size,
                    "entries": prepared.layout.kinds(),
                    "trainable_only": prepared.layout.trainable_only,
                    "state": prepared.shared,
                }
                writer.write_bytes(META_FILE, encode_json(meta))
        except Exception as exc:
            problem = exc
        coll.agree(problem, f"write its state of step {step}")
        gathered = coll.gather(entry.to_dict())
        if coll.is_main:
            writer.add_entries(FileEntry(**e) for e in gathered or [])

    def _committed(
        self,
        step: int,
        save: Save | None,
        writer: CheckpointWriter,
        timings: dict[str, float],
        started: float,
    ) -> None:
        """Every rank, after the marker: rank 0 hands the save to the destination (direct: the
        catalog row with its timings, then retention; the local tier: the local replica and
        the upload), every other rank its own part (the local tier uploads what it wrote)."""
        destination = self.job.destination
        if self.coll.is_main:
            assert save is not None
            if save.writer.manifest is not None:
                self._dedup_base = save.writer.manifest
            destination.committed(save, timings, started)
            if self.on_committed is not None:
                manifest = save.writer.manifest
                size = manifest.total_bytes if manifest is not None else None
                self.on_committed(step, time.monotonic() - started, size)
        else:
            destination.handed_in(step, writer, timings, started)

    def _failed(self, writer: CheckpointWriter, save: Save | None, exc: BaseException) -> None:
        """Rank 0: the save did not complete: fail it (its files and row), or abort the writer
        when no save began."""
        if not self.coll.is_main:
            return
        self._dedup_base = None  # looked up again: the failure may be that it was deleted
        if save is not None:
            self.job.destination.failed(save, exc)
        else:
            with contextlib.suppress(Exception):
                writer.abort()
