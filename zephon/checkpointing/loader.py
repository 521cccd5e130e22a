"""The manager's resume (docs/manager.md, "Resuming"): choose the checkpoint to resume from
(save_dir's latest complete one, or the destination's own copy: the local tier's), register
the job's attempt as resuming from it, plan and run the collective load, and pass over damaged
checkpoints as ``on_corrupt`` says (``damage``). Frozen parameters of a trainable-only
checkpoint come from the source checkpoint (``source``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from zephon import dcp as zdcp
from zephon.attempts import PendingAttempt, Registration
from zephon.checkpointing.damage import (
    DAMAGE,
    damage_on_any_rank,
    report_passed_over,
    set_aside,
)
from zephon.checkpointing.files import (
    DCP_SUBDIR,
    META_FILE,
    META_VERSION,
    decode_json,
    rank_file,
    restore_rng,
)
from zephon.checkpointing.job import ALREADY_COMPLETE, Job
from zephon.checkpointing.layout import StateLayout
from zephon.checkpointing.source import load_frozen_from_source
from zephon.dcp.api import ranges_read
from zephon.errors import ConfigError, CopyUnavailableError, ZephonError
from zephon.latest import LatestCheckpoint, find_latest
from zephon.state_tree import join_state, split_state, tensor_keys
from zephon.storage import CheckpointStore, CorruptCheckpointError, ahead

__all__ = ["LoadPlan", "Loader", "Resume", "ResumePoint"]

log = logging.getLogger("zephon")


@dataclass(frozen=True, slots=True)
class Resume:
    """What ``load_latest`` found and did.

    ``next_step`` is the first step the job should run (1 for a fresh start); ``finished``
    means the job already reached its ``total_steps`` and must stop; ``values`` holds the
    entries that were plain values rather than objects loaded in place.
    """

    step: int | None
    next_step: int
    finished: bool = False
    url: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    rank_state: dict[str, Any] | None = None
    #: the total_steps the checkpoint was saved under (None for a fresh start)
    saved_total_steps: int | None = None

    @property
    def resumed(self) -> bool:
        return self.step is not None


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """The checkpoint rank 0 chose to resume from, sent to every rank."""

    step: int
    url: str
    #: its ``zephon.json``, read and checked on rank 0
    meta: dict[str, Any]
    #: the local tier's copy (every rank reads its own local_dir), not save_dir's
    local: bool = False
    #: a local copy newer than save_dir's latest: uploaded once loaded
    upload: bool = False


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """This rank's part of a load, ready for the collective DCP load."""

    layout: StateLayout
    reader: zdcp.ZephonStorageReader
    #: where DCP loads each tensor: the live objects' tensors, and new ones for this rank's own
    targets: dict[str, Any]
    #: the JSON skeleton of the shared entries (``zephon.json``)
    shared: dict[str, Any]
    #: the skeleton of this rank's own entries
    own: dict[str, Any]
    #: this rank's document (``ranks/<rank>.json``): its state, RNG and ``rank_state``
    document: dict[str, Any]
    #: the world size the checkpoint was saved with is this one (RNG and rank_state apply)
    same_world: bool


class Loader:
    """Resumes one ``Job`` from its latest complete checkpoint."""

    def __init__(self, job: Job) -> None:
        self.job = job
        #: rank 0: the attempt's lineage being read while the destination finds its copy
        self._reading: Future | None = None
        #: rank 0: the attempt's claim, choice and decision being made while the job loads
        self._pending: PendingAttempt | None = None

    def load_latest(self, state: Mapping[str, Any], allow_partial_load: bool) -> Resume:
        """``CheckpointManager.load_latest`` (see there), after background work is done."""
        job, coll = self.job, self.job.coll
        destination = job.destination
        if coll.is_main and not job.reads_only_until_save:
            # the lineage's two requests go out while the destination finds its copy
            self._reading = ahead(lambda: Registration.begin(job.location, job.catalog))
        try:
            return self._load_latest(state, allow_partial_load, destination.resume_candidate())
        except BaseException:
            self._drain()
            raise

    def _load_latest(
        self, state: Mapping[str, Any], allow_partial_load: bool, local: int | None
    ) -> Resume:
        job, coll = self.job, self.job.coll
        destination = job.destination
        while True:
            # One process asks the catalog and reads the small JSON; the others get the answer.
            point: ResumePoint | None = coll.from_main(
                lambda local=local: self._resume_point_on_main(local), "find the latest checkpoint"
            )
            if point is None:
                if not self._registered():
                    continue  # an older attempt committed one meanwhile: choose again
                return Resume(step=None, next_step=1)
            step = point.step
            saved_total = point.meta.get("total_steps")
            if job.total_steps is not None and step >= job.total_steps:
                if not self._registered():
                    continue
                log.info(ALREADY_COMPLETE[job.kind])
                if point.upload:  # the last step, never uploaded: upload it now
                    destination.persist_resumed(step)
                return Resume(
                    step=step,
                    next_step=step + 1,
                    finished=True,
                    url=point.url,
                    saved_total_steps=saved_total,
                )
            # Before the damage check: a source that fails is never this checkpoint's damage.
            self._load_source(point, state)
            problem: Exception | None = None
            store = destination.resume_store if point.local else job.store
            try:
                values, rank_state = self._load(point, state, allow_partial_load, store)
            except Exception as exc:
                problem = exc
            damaged = damage_on_any_rank(coll, problem)
            # Before anything is written (the upload, a quarantine): the attempt registered,
            # and the step it chose once it fenced the older attempts out is the one loaded.
            if not self._registered():
                continue  # an older attempt committed or deleted meanwhile: choose again
            if isinstance(problem, CopyUnavailableError):  # every rank alike; not damage
                if coll.is_main:
                    log.warning("zephon: %s; the next tier is loaded", problem)
                local = destination.next_candidate()
                continue
            if damaged is None:
                if problem is not None:
                    raise problem
                if point.upload:  # never uploaded (the last attempt died): now, fenced
                    destination.persist_resumed(step)
                return Resume(
                    step=step,
                    next_step=step + 1,
                    url=point.url,
                    values=values,
                    rank_state=rank_state,
                    saved_total_steps=saved_total,
                )
            if point.local:  # a damaged copy of the destination's: condemned there only
                if coll.is_main:
                    destination.damaged(step, damaged)
                local = destination.next_candidate()  # its next copy (local disk), or save_dir
                continue
            if job.config.on_corrupt == "fail":
                if problem is not None:
                    raise problem
                why = damaged.splitlines()[0][:300]
                raise ZephonError(
                    f"checkpoint {point.url} could not be loaded on another rank ({why}); "
                    "inspect it (zephon verify), or set on_corrupt: fallback"
                )
            if coll.is_main:
                set_aside(job, step, damaged)

    # -- choosing the checkpoint (rank 0) -----------------------------------------------------

    def _resume_point_on_main(self, local: int | None = None) -> ResumePoint | None:
        """Rank 0: find the latest complete checkpoint and register this job's attempt as
        resuming from it (an inference job only notes it: ``Job.current_attempt`` registers at
        its first save); a checkpoint whose JSON fails verification is set aside and the next
        one taken (raised with ``on_corrupt: fail``). ``local``: the local tier's candidate
        every rank holds, taken if it is at least save_dir's latest (and uploaded after the
        load if it is newer)."""
        job = self.job
        destination = job.destination
        while True:

            def passed_over(step: int, why: str) -> None:
                report_passed_over(job, step, why)

            def choose(
                lineage, local=local
            ) -> tuple[int | None, tuple[LatestCheckpoint | None, bool]]:
                if local is not None and job.catalog is not None:
                    # The catalog's newest committed row at or below L: L wins (judged by the
                    # lineage the claim read) and R's marker is not read, since R is not loaded.
                    latest = find_latest(
                        job.location,
                        catalog=job.catalog,
                        lineage=lineage,
                        on_corrupt=passed_over,
                        confirm=False,
                    )
                    remote = latest.step if latest is not None else None
                    if (remote is None or remote <= local) and destination.prefers(
                        local, lineage, remote
                    ):
                        return local, (latest, True)
                latest = find_latest(
                    job.location, catalog=job.catalog, lineage=lineage, on_corrupt=passed_over
                )
                remote = latest.step if latest is not None else None
                if destination.prefers(local, lineage, remote):
                    return local, (latest, True)
                return remote, (latest, False)

            if job.reads_only_until_save:  # no attempt until its first save (Job.current_attempt)
                _, (latest, use_local) = choose(job.store.run(job.location.storage_run).lineage())
            else:
                # Chosen on the lineage as it will be once claimed; the claim and the decision
                # are written while every rank loads, and confirmed before the job goes on.
                self._settle()  # a choice passed over (damaged): its registration first
                registration = self._begin_registration()
                try:
                    step, (latest, use_local) = choose(registration.lineage)
                except BaseException:
                    registration.abandon()
                    raise
                self._pending = registration.decide_in_background(step, choose)
            if use_local and local is not None:
                try:
                    meta = self._read_meta(local, destination.resume_store)
                except DAMAGE as exc:
                    destination.damaged(local, str(exc))
                    local = None
                    continue
                newer = latest is None or latest.step < local
                job.session.note_loaded(local)
                return ResumePoint(
                    local, destination.checkpoint_url(local), meta, local=True, upload=newer
                )
            if latest is None:
                return None
            try:
                meta = self._read_meta(latest.step, job.store)
            except DAMAGE as exc:
                if job.config.on_corrupt == "fail":
                    raise  # docs/manager.md: a damaged checkpoint is raised, not passed over
                set_aside(job, latest.step, str(exc))
                continue
            job.session.note_loaded(latest.step)
            return ResumePoint(latest.step, latest.url, meta)

    def _begin_registration(self) -> Registration:
        """Rank 0: the registration whose lineage was read ahead, else read now."""
        reading, self._reading = self._reading, None
        if reading is not None:
            return reading.result()
        return Registration.begin(self.job.location, self.job.catalog)

    def _settle(self) -> bool:
        """Rank 0: wait for the attempt's claim, choice and decision being made
        (``Registration``), hold the attempt in the session, and say whether the choice the
        job loaded stands (True when nothing was pending)."""
        if self._pending is None:
            return True
        pending, self._pending = self._pending, None
        self.job.session.attempt, stands = pending.wait()
        return stands

    def _drain(self) -> None:
        """Rank 0, when the load stopped on an error: wait for the requests under way (their
        own failures give way to that error), and hold the attempt if it was written."""
        reading, self._reading = self._reading, None
        pending, self._pending = self._pending, None
        with contextlib.suppress(Exception):
            if reading is not None:
                reading.result().abandon()
        with contextlib.suppress(Exception):
            attempt = pending.written() if pending is not None else None
            if attempt is not None:
                self.job.session.attempt = attempt

    def _registered(self) -> bool:
        """Collective: wait until rank 0's attempt is registered (its failure is raised on
        every rank); whether the choice the job loaded stands."""

        def settle() -> bool:
            reading, self._reading = self._reading, None
            if reading is not None:  # read ahead but not used (an inference job's start)
                reading.result().abandon()
            return self._settle()

        return self.job.coll.from_main(settle, "register the job's attempt")

    def _read_meta(self, step: int, store: CheckpointStore) -> dict[str, Any]:
        """Checkpoint ``step``'s ``zephon.json``; ``CorruptCheckpointError`` if it is not one
        (damage: the checkpoint is set aside), ``ZephonError`` if a newer Zephon wrote it."""
        reader = store.run(self.job.run).reader(step, verify=self.job.config.verify_on_load)
        where = f"{reader.url}/{META_FILE}"
        meta = _document(decode_json(reader.read_bytes(META_FILE), where), where, "entries")
        if meta.get("format_version", 0) > META_VERSION:
            raise ZephonError(f"{reader.url} was written by a newer Zephon; upgrade to load it")
        return meta

    # -- loading (every rank) -----------------------------------------------------------------

    def _load(
        self,
        point: ResumePoint,
        state: Mapping[str, Any],
        allow_partial_load: bool,
        store: CheckpointStore,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Collective: load checkpoint ``point`` into ``state``; (plain values, rank_state)."""
        job, coll = self.job, self.job.coll
        plan: LoadPlan | None = None
        problem: Exception | None = None
        reads: dict[str, list[tuple[int, int]]] | None = None
        try:
            plan = self._plan(point, state, allow_partial_load, store)
            if point.local:  # what this rank reads of the destination's copy
                reads = ranges_read(
                    plan.targets, plan.reader, allow_partial_load=allow_partial_load
                )
        except Exception as exc:
            problem = exc
        # Every rank must be ready before the collective load, or the others would wait forever.
        coll.agree(problem, f"prepare loading step {point.step}")
        assert plan is not None
        if point.local:  # what this rank reads, where it is not yet (peers' memory)
            job.destination.fetch_reads(point.step, reads)
        kinds = plan.layout.kinds()
        zdcp.load(
            plan.targets,
            plan.reader,
            process_group=coll.io_group,
            allow_partial_load=allow_partial_load,
        )
        tree = join_state({k: v for k, v in plan.shared.items() if k in kinds}, plan.targets)
        tree.update(join_state(plan.own, plan.targets))
        values = plan.layout.apply(tree)
        rank_state = None
        if plan.same_world:
            if job.save_rng and "rng" in plan.document:
                restore_rng(plan.document["rng"])
            if "rank_state" in plan.document:
                rank_state = join_state(plan.document["rank_state"], {})
        return values, rank_state

    def _plan(
        self,
        point: ResumePoint,
        state: Mapping[str, Any],
        allow_partial_load: bool,
        store: CheckpointStore,
    ) -> LoadPlan:
        """This rank's part of a load, before the collective: check the state against the
        checkpoint, load frozen parameters from the source, read this rank's JSON."""
        job, meta, step = self.job, point.meta, point.step
        layout = StateLayout(state, trainable_only=bool(meta.get("trainable_only")))
        kinds = layout.kinds()
        saved_kinds: dict[str, str] = meta["entries"]
        mismatched = [k for k, kind in kinds.items() if k in saved_kinds and saved_kinds[k] != kind]
        if mismatched:
            was = [saved_kinds[k] for k in mismatched]
            now = [kinds[k] for k in mismatched]
            raise ZephonError(
                f"state entries {mismatched} were saved as {was} but are {now} now; pass the "
                "same kinds of objects that were saved"
            )
        url = store.run(job.run).checkpoint_url(step)
        checkpoint = store.run(job.run).reader(step, verify=job.config.verify_on_load)
        # The same world size gets every rank its own state back; another one (an elastic
        # resume) gets every rank rank 0's, and no RNG or rank_state.
        same_world = meta.get("world_size") == job.coll.world_size
        name = rank_file(job.coll.rank if same_world else 0)
        where = f"{checkpoint.url}/{name}"
        document = _document(decode_json(checkpoint.read_bytes(name), where), where)
        targets, _ = split_state(layout.load_targets())
        shared = meta["state"]
        saved = set(tensor_keys({k: v for k, v in shared.items() if k in kinds}))
        extra = sorted(saved - set(targets))
        if extra and not allow_partial_load:
            shown = ", ".join(extra[:10]) + (" ..." if len(extra) > 10 else "")
            raise zdcp.StateDictMismatchError(
                f"checkpoint {url} holds {len(extra)} tensor(s) this state has no place for: "
                f"{shown}; build the model and optimizer as they were when saved"
            )
        reader = zdcp.ZephonStorageReader(
            store, job.run, step, subdir=DCP_SUBDIR, verify=job.config.verify_on_load
        )
        own = {k: v for k, v in document["state"].items() if k in kinds}
        own_keys = tensor_keys(own)
        if own_keys:  # this rank's own tensors: allocated from the checkpoint's metadata
            metadata = reader.read_metadata()
            for key in own_keys:
                md = metadata.state_dict_metadata[key]
                targets[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return LoadPlan(
            layout=layout,
            reader=reader,
            targets=targets,
            shared=shared,
            own=own,
            document=document,
            same_world=same_world,
        )

    def _load_source(self, point: ResumePoint, state: Mapping[str, Any]) -> None:
        """Collective when ``point`` holds only trainable parameters: the frozen ones, from the
        source checkpoint, on every rank. Its failure (a ``ConfigError`` without a source, the
        source's ``CheckpointNotFoundError``...) is raised as it is: the source's problem, not
        damage of ``point``, which is neither quarantined nor passed over for it."""
        if not point.meta.get("trainable_only"):
            return
        problem: Exception | None = None
        try:
            source = self.job.model_stage.source_checkpoint
            if source is None:
                raise ConfigError(
                    f"checkpoint {point.url} holds only trainable parameters; set "
                    "model_stage_factory.source_checkpoint to load the frozen ones"
                )
            layout = StateLayout(state, trainable_only=True)
            for key in layout.model_keys:
                entry = next(e for e in layout.entries if e.key == key)
                value = entry.value
                modules = [value] if isinstance(value, torch.nn.Module) else list(value)
                config = self.job.config
                load_frozen_from_source(modules, source, config.storage_options, config.retry)
        except Exception as exc:
            problem = exc
        self.job.coll.agree(problem, f"load the frozen parameters of step {point.step}")


def _document(value: Any, where: str, *mappings: str) -> dict[str, Any]:
    """``value``, a JSON document of a checkpoint, if it has the shape Zephon writes: an
    object whose ``state`` (and each of ``mappings``) is an object. Anything else was not
    written by Zephon or is damaged: ``CorruptCheckpointError`` naming the file."""
    keys = ("state", *mappings)
    if isinstance(value, dict) and all(isinstance(value.get(k), dict) for k in keys):
        return value
    raise CorruptCheckpointError(
        f"{where} is not a Zephon checkpoint document (it needs the objects {', '.join(keys)}); "
        "the checkpoint is damaged: resume from an earlier one",
        url=where,
        problems=[f"{where}: not a Zephon checkpoint document"],
    )
