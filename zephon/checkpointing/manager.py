"""``CheckpointManager``: what a training or inference job calls to save every
``period_steps``, keep ``num_to_keep`` and resume exactly (docs/manager.md).

Call every method on every rank, at the same point of the program: they are collectives on a
gloo process group of the manager's own. Rank 0 alone talks to the catalog and commits.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from catalog import Catalog
from storage import (
    CheckpointNotFoundError,
    CheckpointStore,
    CheckpointWriter,
    CorruptCheckpointError,
    FileEntry,
    InvalidNameError,
    validate_run,
)
from zephon import dcp as zdcp
from zephon.attempts import Attempt, as_zephon_error, fenced, register_resuming
from zephon.checkpointing.collectives import Collectives
from zephon.checkpointing.files import (
    DCP_SUBDIR,
    META_FILE,
    META_VERSION,
    capture_rng,
    decode_json,
    encode_json,
    rank_file,
    restore_rng,
)
from zephon.checkpointing.layout import IN_PLACE, PER_RANK, StateLayout
from zephon.checkpointing.source import load_frozen_from_source
from zephon.checkpointing.tiering import Tiering
from zephon.config import MAX_STEP, CheckpointingConfig, ModelStageConfig
from zephon.errors import ConfigError, ZephonError
from zephon.gc import apply_retention
from zephon.latest import LatestCheckpoint, find_latest
from zephon.locations import RunLocation, inference_run_name
from zephon.reconcile import quarantine
from zephon.saving import Save
from zephon.state_tree import join_state, split_state, tensor_keys

__all__ = ["CheckpointManager", "Resume", "ALREADY_COMPLETE"]

log = logging.getLogger("zephon")

ALREADY_COMPLETE = {
    "train": "Training is already complete, nothing to do",
    "inference": "Inference is already complete, nothing to do",
}


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


class CheckpointManager:
    """Saves and resumes one job's checkpoints under ``config.save_dir``.

    ``kind="train"`` needs ``run_name`` (checkpoints at ``<save_dir>/<run>/save-<step>``);
    ``kind="inference"`` has none (``<save_dir>/save-<step>``; its catalog name defaults to the
    last component of ``save_dir``). Steps count completed steps, from 1 to ``total_steps``.
    """

    def __init__(
        self,
        config: CheckpointingConfig,
        *,
        run_name: str | None = None,
        total_steps: int | None = None,
        kind: str = "train",
        model_stage: ModelStageConfig | None = None,
        catalog_name: str | None = None,
        save_rng: bool = True,
    ) -> None:
        if kind not in ALREADY_COMPLETE:
            raise ConfigError(f"kind = {kind!r} is invalid: use 'train' or 'inference'")
        if kind == "train" and run_name is None:
            raise ConfigError("a training job needs run_name (run.name in the job config)")
        if run_name is not None:
            try:
                validate_run(run_name)
            except InvalidNameError as exc:
                raise ConfigError(f"run_name: {exc}") from None
        if kind == "inference" and run_name is not None:
            raise ConfigError(
                "an inference job has no run name (it saves to <save_dir>/save-<step>); pass "
                "catalog_name to name it in the catalog"
            )
        if total_steps is not None and (
            isinstance(total_steps, bool)
            or not isinstance(total_steps, int)
            or not 1 <= total_steps <= MAX_STEP
        ):
            raise ConfigError(
                f"total_steps = {total_steps!r} is invalid: use an integer from 1 to {MAX_STEP}"
            )
        self.config = config
        self.kind = kind
        self.total_steps = total_steps
        self.model_stage = model_stage or ModelStageConfig()
        self.save_rng = save_rng
        self.store = CheckpointStore(config.save_dir, config.storage_options)
        self.run = run_name
        self.name = (
            catalog_name or run_name or inference_run_name(self.store.location.canonical_url)
        )
        self.location = RunLocation(self.name, self.store, self.run)
        self.coll = Collectives()
        self.catalog: Catalog | None = None
        #: rank 0: this job's attempt, registered by ``load_latest`` (or the first save)
        self.attempt: Attempt | None = None

        def open_catalog_on_main() -> None:
            if config.resolved_catalog_url:
                self.catalog = self._open_catalog(config.resolved_catalog_url)

        #: the local tier (``local_dir``) and its uploads, if configured
        self.tier: Tiering | None = None
        try:
            self.coll.from_main(open_catalog_on_main, "set up checkpointing")
            if config.local_dir is not None:
                self.tier = Tiering(
                    config,
                    self.coll,
                    self.location,
                    self.catalog,
                    attempt=self._current_attempt,
                    retain=self.apply_retention,
                )
        except BaseException:
            self.coll.destroy()
            raise
        self._background: Future | None = None
        self._async_stager: zdcp.ZephonStager | None = None
        self._background_lock = threading.Lock()

    def _open_catalog(self, url: str) -> Catalog:
        catalog = Catalog(url)
        try:
            catalog.ensure_run(
                self.name,
                self.store.location.canonical_url,
                kind=self.kind,
                status="active",
                total_steps=self.total_steps,
                num_to_keep=self.config.num_to_keep,
                keep_every_steps=self.config.keep_every_steps,
            )
        except BaseException:
            catalog.close()
            raise
        return catalog

    # -- when -------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether the job saves after completing ``step``: every ``period_steps`` and at the
        last step; only at the last step; or never."""
        return self.config.saves_at(step, self.total_steps)

    def maybe_save(self, step: int, state: Mapping[str, Any], **kwargs: Any) -> bool:
        """``save`` if ``should_save(step)``; returns whether it saved."""
        if not self.should_save(step):
            return False
        self.save(step, state, **kwargs)
        return True

    # -- save -------------------------------------------------------------------------------

    def save(
        self, step: int, state: Mapping[str, Any], *, rank_state: Mapping[str, Any] | None = None
    ) -> None:
        """Save ``state`` as checkpoint ``step`` (collective).

        All ranks wait before and after. Tensors go through torch DCP (every rank writes its own
        shards), everything else as JSON; rank 0 commits the marker, then the catalog row, then
        applies retention. With ``async_save`` this returns once tensors are staged in host
        memory; the rest happens in the background and a failure is raised by the next call.
        A failure on any rank raises on every rank; nothing of the attempt is left behind.
        """
        started = time.monotonic()
        self._wait_background()
        #: the phases of this save, completed as they happen (the catalog row gets them)
        timings: dict[str, float] = {}
        prepared, problem = None, None
        try:
            if self.tier is not None:
                self.tier.before_save()  # backpressure; a stale attempt stops here
            prepared = self._prepare(state, rank_state)
        except Exception as exc:
            problem = exc
        # Doubles as the barrier before the save.
        self.coll.agree(problem, f"prepare the state of step {step}")
        layout, tensors, shared, mine = prepared
        store = self.tier.store if self.tier is not None else self.store
        save, primary = None, None
        if self.coll.is_main:
            try:
                attempt = self._current_attempt()
                if self.tier is not None:
                    save = self.tier.begin(attempt, step)
                else:
                    save = Save.begin(attempt, step, catalog=self.catalog)
                primary = save.writer
            except Exception as exc:
                problem = exc
        try:
            writer = zdcp.attach_ranks(
                store, self.run, step, primary, process_group=self.coll.group
            )
        except Exception:
            if problem is not None:
                raise problem from None
            raise
        try:
            self._write_json(writer, step, layout, shared, mine)
            storage_writer = zdcp.ZephonStorageWriter(
                writer, subdir=DCP_SUBDIR, commit_metadata={"step": step, "kind": self.kind}
            )
            if self.config.async_save:
                staging = time.monotonic()
                future = zdcp.async_save(
                    tensors,
                    storage_writer,
                    process_group=self.coll.io_group,
                    stager=self._stager(),
                )
                timings["stage_s"] = time.monotonic() - staging
                returned = threading.Event()  # the commit records stall_s, known once we return
                self._start_background(step, future, writer, save, timings, started, returned)
                try:
                    self.coll.barrier()
                    timings["stall_s"] = time.monotonic() - started
                finally:
                    returned.set()
                return
            zdcp.save(tensors, storage_writer, process_group=self.coll.io_group)
        except BaseException as exc:
            self._failed(writer, save, exc)
            translated = as_zephon_error(exc)
            if translated is not exc:  # the commit met a newer attempt
                raise translated from exc
            raise
        timings["stall_s"] = time.monotonic() - started
        self._committed(step, save, writer, timings, started)
        self.coll.barrier()

    def _prepare(self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None):
        """This rank's part of a save, before anything is written: classify the state, split
        tensors from JSON, and build this rank's own JSON document."""
        layout = StateLayout(
            state, trainable_only=self.model_stage.checkpoint_only_trainable_parameters
        )
        # Models and optimizers are shared by all ranks (DCP reshards them); every other entry
        # is this rank's own, its tensors keyed under rank<r>/ so DCP keeps every rank's copy.
        tensors, shared = split_state(layout.state_tree(IN_PLACE))
        own_tensors, own = split_state(layout.state_tree(PER_RANK), (f"rank{self.coll.rank}",))
        tensors.update(own_tensors)
        mine: dict[str, Any] = {"state": own}
        if self.save_rng:
            mine["rng"] = capture_rng()
        if rank_state is not None:
            _, rank_skeleton = split_state(dict(rank_state))
            if tensor_keys(rank_skeleton):
                raise ZephonError("rank_state holds tensors: keep per-rank state to JSON values")
            mine["rank_state"] = rank_skeleton
        return layout, tensors, shared, mine

    def _current_attempt(self) -> Attempt:
        """Rank 0: this job's attempt. A job that saves without ``load_latest`` registers one
        that continues the run's latest checkpoint (it never abandons history implicitly)."""
        if self.attempt is None:

            def continue_latest(lineage):
                latest = find_latest(
                    self.location,
                    catalog=self.catalog,
                    lineage=lineage,
                    on_corrupt=self._on_damaged,
                )
                return (latest.step if latest is not None else None), None

            self.attempt, _ = register_resuming(self.location, self.catalog, continue_latest)
        return self.attempt

    def _write_json(
        self,
        writer: CheckpointWriter,
        step: int,
        layout: StateLayout,
        shared: Any,
        mine: dict[str, Any],
    ) -> None:
        """Every rank writes ``ranks/<rank>.json`` (rank 0 also ``zephon.json``); rank 0 then
        records every rank's file in the manifest."""
        entry, problem = None, None
        try:
            entry = writer.write_bytes(rank_file(self.coll.rank), encode_json(mine))
            if self.coll.is_main:
                meta = {
                    "format_version": META_VERSION,
                    "run": self.run,
                    "name": self.name,
                    "kind": self.kind,
                    "step": step,
                    "total_steps": self.total_steps,
                    "world_size": self.coll.world_size,
                    "entries": layout.kinds(),
                    "trainable_only": layout.trainable_only,
                    "state": shared,
                }
                writer.write_bytes(META_FILE, encode_json(meta))
        except Exception as exc:
            problem = exc
        self.coll.agree(problem, f"write its state of step {step}")
        gathered = self.coll.gather(entry.to_dict())
        if self.coll.is_main:
            writer.add_entries(FileEntry(**e) for e in gathered or [])

    def _committed(
        self,
        step: int,
        save: Save | None,
        writer: CheckpointWriter,
        timings: dict[str, float],
        started: float,
    ) -> None:
        """Every rank, after the marker. Without a local tier, rank 0 records the commit (with
        its timings) and applies retention; with one, the local commit is recorded and every
        rank queues the upload of what it wrote."""
        if self.tier is not None:
            self.tier.committed(step, save, writer, timings, started)
        elif self.coll.is_main:
            assert save is not None
            save.committed(timings=timings)
            self.apply_retention()

    def _failed(self, writer: CheckpointWriter, save: Save | None, exc: BaseException) -> None:
        if not self.coll.is_main:
            return
        if save is not None:
            save.failed(exc)
            if self.tier is not None:
                self.tier.failed(save, exc)
        else:
            with contextlib.suppress(Exception):
                writer.abort()

    def apply_retention(self) -> list[int]:
        """Rank 0: delete the checkpoints ``num_to_keep`` no longer keeps (docs/manager.md: after
        each save, the main process deletes the oldest). Returns the deleted steps."""
        if not self.coll.is_main:
            return []
        return apply_retention(
            self.location,
            self.catalog,
            self._current_attempt().fence,
            self.config.num_to_keep,
            self.config.keep_every_steps,
        )

    # -- background saves ---------------------------------------------------------------------

    def _start_background(
        self,
        step,
        future: Future,
        writer,
        save: Save | None,
        timings,
        started: float,
        returned: threading.Event,
    ) -> None:
        done: Future = Future()

        def finish(upload: Future) -> None:
            try:
                upload.result()
                returned.wait()
                self._committed(step, save, writer, timings, started)
            except BaseException as exc:  # noqa: BLE001 - surfaced by the next call
                self._failed(writer, save, exc)
                done.set_exception(as_zephon_error(exc))
                return
            done.set_result(step)

        future.add_done_callback(
            lambda f: threading.Thread(
                target=finish, args=(f,), name=f"zephon-commit-{step}", daemon=True
            ).start()
        )
        with self._background_lock:
            self._background = done

    def _stager(self) -> zdcp.ZephonStager:
        """One stager for the job's async saves: its host buffers are reused by the next save
        (which waits for the previous one first), instead of allocated anew each time."""
        if self._async_stager is None:
            self._async_stager = zdcp.ZephonStager()
        return self._async_stager

    def wait(self) -> None:
        """Wait for a background save and every pending upload; raise a failure, if one
        failed."""
        self._wait_background()
        if self.tier is not None:
            self.tier.wait()

    def _wait_background(self) -> None:
        with self._background_lock:
            pending, self._background = self._background, None
        if pending is not None:
            pending.result()

    # -- resume -------------------------------------------------------------------------------

    def load_latest(self, state: Mapping[str, Any], *, allow_partial_load: bool = False) -> Resume:
        """Load the latest complete checkpoint into ``state`` (collective) and say where to go.

        No checkpoint: a fresh start at step 1. Interrupted: continue from the step after the
        checkpoint (an inference job's data position makes it skip what it processed). Raised
        ``total_steps``: continue to the new last step. Finished: log "Training is already
        complete, nothing to do" (or "Inference ...") and return ``finished=True``.

        Registers this job's attempt (its fencing token), resuming from the step found: from
        then on an older attempt still running cannot save, mark or delete anything of the run.
        Every byte loaded is checked against its CRC32C (``verify_on_load``); a checkpoint that
        fails (or vanished meanwhile) is quarantined, one log line says so, and the next
        complete one is loaded, unless ``on_corrupt`` is ``"fail"``.
        """
        self.wait()
        local = self.tier.candidate() if self.tier is not None else None
        while True:
            # One process asks the catalog and reads the small JSON; the others get the answer.
            answer = self.coll.from_main(
                lambda local=local: self._resume_point_on_main(local), "find the latest checkpoint"
            )
            if answer is None:
                return Resume(step=None, next_step=1)
            found, meta = answer
            step = found["step"]
            saved_total = meta.get("total_steps")
            if self.total_steps is not None and step >= self.total_steps:
                log.info(ALREADY_COMPLETE[self.kind])
                if found.get("upload"):  # the last step, never uploaded: upload it now
                    self.tier.upload_resumed(step)
                return Resume(
                    step=step,
                    next_step=step + 1,
                    finished=True,
                    url=found["url"],
                    saved_total_steps=saved_total,
                )
            problem: Exception | None = None
            store = self.tier.store if found.get("local") and self.tier else self.store
            try:
                values, rank_state = self._load(step, meta, state, allow_partial_load, store)
            except Exception as exc:
                problem = exc
            damaged = self._damage_on_any_rank(problem)
            if damaged is None:
                if problem is not None:
                    raise problem
                if found.get("upload"):  # never uploaded (the last attempt died): now, fenced
                    self.tier.upload_resumed(step)
                return Resume(
                    step=step,
                    next_step=step + 1,
                    url=found["url"],
                    values=values,
                    rank_state=rank_state,
                    saved_total_steps=saved_total,
                )
            if found.get("local"):  # a damaged local copy: condemned there only, save_dir next
                if self.coll.is_main and self.tier is not None:
                    self.tier.damaged(step, damaged)
                local = None
                continue
            if self.config.on_corrupt == "fail":
                if problem is not None:
                    raise problem
                raise ZephonError(f"checkpoint {found['url']} could not be loaded: {damaged}")
            if self.coll.is_main:
                self._set_aside(step, damaged)

    def _resume_point_on_main(
        self, local: int | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Rank 0: find the latest complete checkpoint and register this job's attempt as
        resuming from it; a checkpoint whose JSON fails verification is set aside and the next
        one taken. ``local``: the local tier's candidate every rank holds, taken if it is at
        least save_dir's latest (and uploaded after the load if it is newer)."""
        while True:

            def choose(
                lineage, local=local
            ) -> tuple[int | None, tuple[LatestCheckpoint | None, bool]]:
                if local is not None and self.tier is not None and self.catalog is not None:
                    # The catalog's newest committed row at or below L: L wins (judged by the
                    # lineage the claim read) and R's marker is not read, since R is not loaded.
                    latest = find_latest(
                        self.location,
                        catalog=self.catalog,
                        lineage=lineage,
                        on_corrupt=self._on_damaged,
                        confirm=False,
                    )
                    remote = latest.step if latest is not None else None
                    if (remote is None or remote <= local) and self.tier.prefers(
                        local, lineage, remote
                    ):
                        return local, (latest, True)
                latest = find_latest(
                    self.location,
                    catalog=self.catalog,
                    lineage=lineage,
                    on_corrupt=self._on_damaged,
                )
                remote = latest.step if latest is not None else None
                if self.tier is not None and self.tier.prefers(local, lineage, remote):
                    return local, (latest, True)
                return remote, (latest, False)

            self.attempt, (latest, use_local) = register_resuming(
                self.location, self.catalog, choose
            )
            if use_local and self.tier is not None and local is not None:
                try:
                    meta = self._read_meta(local, self.tier.store)
                except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                    self.tier.damaged(local, str(exc))
                    local = None
                    continue
                url = self.tier.checkpoint_url(local)
                newer = latest is None or latest.step < local
                return {"step": local, "url": url, "local": True, "upload": newer}, meta
            if latest is None:
                return None
            try:
                meta = self._read_meta(latest.step)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                self._set_aside(latest.step, str(exc))
                continue
            return {"step": latest.step, "url": latest.url}, meta

    def _damage_on_any_rank(self, problem: Exception | None) -> str | None:
        """Collective: what made the load fail, if on any rank it was damage (a checksum or
        size mismatch, a file gone); None if every rank loaded or failed for another reason."""
        mine = None
        if isinstance(problem, CorruptCheckpointError | CheckpointNotFoundError):
            mine = f"{type(problem).__name__}: {problem}"
        reports = self.coll.all_gather(mine)
        return next((r for r in reports if r is not None), None)

    def _on_damaged(self, step: int, why: str) -> None:
        """Rank 0: ``find_latest`` passed over a damaged checkpoint (it quarantines it): say so
        in one line, or stop there with ``on_corrupt: fail``."""
        url = self.store.checkpoint_url(self.run, step)
        if self.config.on_corrupt == "fail":
            raise CorruptCheckpointError(
                f"checkpoint {url} is damaged ({why.splitlines()[0][:300]}); it is not loaded and "
                "no older one is taken (on_corrupt: fail): inspect it, or set on_corrupt: "
                "fallback",
                url=url,
                run=self.run,
                step=step,
                problems=[why[:300]],
            )
        log.warning(
            "zephon: checkpoint %s is damaged (%s); it is quarantined and an older one is taken",
            url,
            why.splitlines()[0][:300],
        )

    def _set_aside(self, step: int, why: str) -> None:
        """Rank 0: quarantine a checkpoint that failed to load and say so in one line."""
        url = self.store.checkpoint_url(self.run, step)
        try:
            manifest = self.store.read_manifest(self.run, step)
        except (CorruptCheckpointError, CheckpointNotFoundError):
            manifest = None
        with contextlib.suppress(Exception):
            quarantine(self.catalog, self.location, step, why[:2000], manifest=manifest)
        log.warning(
            "zephon: checkpoint %s failed verification or vanished (%s); it is quarantined and "
            "the next complete checkpoint is loaded",
            url,
            why.splitlines()[0][:300],
        )

    def _read_meta(self, step: int, store: CheckpointStore | None = None) -> dict[str, Any]:
        store = store or self.store
        reader = store.reader(self.run, step, verify=self.config.verify_on_load)
        meta = decode_json(reader.read_bytes(META_FILE), f"{reader.url}/{META_FILE}")
        if meta.get("format_version", 0) > META_VERSION:
            raise ZephonError(f"{reader.url} was written by a newer Zephon; upgrade to load it")
        return meta

    def _load(
        self,
        step: int,
        meta: dict[str, Any],
        state: Mapping[str, Any],
        allow_partial_load: bool,
        store: CheckpointStore,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        planned, problem = None, None
        try:
            planned = self._plan_load(step, meta, state, allow_partial_load, store)
        except Exception as exc:
            problem = exc
        # Every rank must be ready before the collective load, or the others would wait forever.
        self.coll.agree(problem, f"prepare loading step {step}")
        layout, reader, targets, shared, own, mine, same_world = planned
        kinds = layout.kinds()
        zdcp.load(
            targets, reader, process_group=self.coll.io_group, allow_partial_load=allow_partial_load
        )
        tree = join_state({k: v for k, v in shared.items() if k in kinds}, targets)
        tree.update(join_state(own, targets))
        values = layout.apply(tree)
        rank_state = None
        if same_world:
            if self.save_rng and "rng" in mine:
                restore_rng(mine["rng"])
            if "rank_state" in mine:
                rank_state = join_state(mine["rank_state"], {})
        return values, rank_state

    def _plan_load(
        self,
        step: int,
        meta: dict[str, Any],
        state: Mapping[str, Any],
        allow_partial_load: bool,
        store: CheckpointStore,
    ):
        """This rank's part of a load, before the collective: check the state against the
        checkpoint, load frozen parameters from the source, read this rank's JSON."""
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
        if layout.trainable_only:
            self._load_source(layout)
        url = store.checkpoint_url(self.run, step)
        checkpoint = store.reader(self.run, step, verify=self.config.verify_on_load)
        # The same world size gets every rank its own state back; another one (an elastic
        # resume) gets every rank rank 0's, and no RNG or rank_state.
        same_world = meta.get("world_size") == self.coll.world_size
        name = rank_file(self.coll.rank if same_world else 0)
        mine = decode_json(checkpoint.read_bytes(name), f"{checkpoint.url}/{name}")
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
            store, self.run, step, subdir=DCP_SUBDIR, verify=self.config.verify_on_load
        )
        own = {k: v for k, v in mine["state"].items() if k in kinds}
        own_keys = tensor_keys(own)
        if own_keys:  # this rank's own tensors: allocated from the checkpoint's metadata
            metadata = reader.read_metadata()
            for key in own_keys:
                md = metadata.state_dict_metadata[key]
                targets[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return layout, reader, targets, shared, own, mine, same_world

    def _load_source(self, layout: StateLayout) -> None:
        source = self.model_stage.source_checkpoint
        if source is None:
            raise ConfigError(
                "this checkpoint holds only trainable parameters; set "
                "model_stage_factory.source_checkpoint to load the frozen ones"
            )
        for key in layout.model_keys:
            entry = next(e for e in layout.entries if e.key == key)
            modules = (
                [entry.value] if isinstance(entry.value, torch.nn.Module) else list(entry.value)
            )
            load_frozen_from_source(modules, source, self.config.storage_options)

    # -- end ------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for background work and mark the run finished in the catalog."""
        self.wait()
        if self.catalog is not None:
            epoch = self.attempt.epoch if self.attempt is not None else None
            with fenced():
                self.catalog.update_run(self.name, status="finished", epoch=epoch)

    def close(self) -> None:
        """Wait for background work, then release the catalog and the process group."""
        try:
            self.wait()
        finally:
            if self.tier is not None:
                self.tier.close()
                self.tier = None
            if self._async_stager is not None:
                self._async_stager.close()
                self._async_stager = None
            if self.catalog is not None:
                self.catalog.close()
                self.catalog = None
            self.coll.destroy()
            self.store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
