"""``zephon.dcp.Writer``: a drop-in DCP storage writer addressed by URL.

``dcp.save(sd, storage_writer=Writer("s3://bucket/ckpt/run", step=100))`` on every rank writes
checkpoint ``s3://bucket/ckpt/run/save-100`` through the project's one save path. The Writer
holds a run session (``zephon.session.RunSession``, the checkpoint manager's too) and the
destination it chose once (``zephon.destinations``: ``url`` directly, or ``local_dir`` first):
the coordinator registers the job's attempt on the Writer's first save, begins the save through
the destination (``zephon.saving.Save``: catalog row ``pending``, fenced storage ``begin``)
while DCP plans, so before any rank writes; the save id travels to the other ranks inside the
plan. Every rank then writes its shards with ``ZephonStorageWriter``'s code; ``finish`` commits
the marker and hands the checkpoint to the destination (the row ``committed`` and retention,
or the local replica and its upload). See "Drop-in writer and reader" in ``docs/dcp.md``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from zephon.attempts import Attempt, fenced
from zephon.collectives import Collectives
from zephon.dcp.addressing import RunURL, check_step, parse_run_url, step_of_checkpoint_id
from zephon.dcp.errors import WriterSetupError, portable
from zephon.dcp.writer import CommitMetadata, ZephonStorageWriter, _FilePrefix
from zephon.destinations import Destination, TierConfig
from zephon.errors import ConfigError, as_zephon_error, invalid_option
from zephon.locations import RunLocation
from zephon.retention import Retention, check_resume_step
from zephon.saving import Save
from zephon.session import CatalogArg, RunSession, resolve_catalog
from zephon.storage import CheckpointStore, CheckpointWriter, ChunkRef, Manifest, RetryPolicy

__all__ = ["RunURL", "Writer", "parse_run_url"]


@dataclass(frozen=True)
class _RankWants:
    """What a rank tells the coordinator it is about to write (``SavePlan.storage_data``)."""

    rank: int
    root: str
    run: str
    step: int | None
    url: str


@dataclass(frozen=True)
class _SaveTarget:
    """The coordinator's answer, per rank: the save every rank attaches to, its file prefix."""

    save_id: str
    step: int
    prefix: str
    #: a deduplicated save: the base's chunks of this rank's shards (``_FilePrefix.base``)
    base: tuple[ChunkRef, ...] | None = None
    scope: str = "run"


class Writer(ZephonStorageWriter):
    """DCP ``StorageWriter`` for the run at ``url`` (``<save_dir>/<run>``); construct it the same
    way on every rank.

    ``step`` is the step of the next save; ``dcp.save(..., checkpoint_id="<url>/save-<n>")``
    (DCP calls ``reset``) sets it instead, so one Writer serves a whole job. Keep one Writer per
    job: its first save registers the job's attempt, and a second Writer of the same run
    registers a newer one, which fences out the first (a save of it still in flight then fails
    with ``zephon.StaleAttemptError``). ``resume_step`` is the step the job resumed from (0:
    it starts over): the attempt abandons the run's older checkpoints above it. Without it the
    attempt continues the run's latest complete checkpoint, and a save below that one is
    refused (``zephon.SaveBelowLatestError``): a job that restarted from scratch by mistake
    never mixes a second history into the run.

    ``catalog`` (a ``catalog.Catalog`` or its URL, opened on the coordinator only; without it
    ``$ZEPHON_CATALOG_URL``, if set) records every save. ``num_to_keep`` keeps that many newest
    checkpoints, ``keep_every_steps`` also every checkpoint whose step is a multiple of it;
    checked as every entry point's (``zephon.retention``) and authoritative: with a catalog
    they become the run's policy, None included (keep every checkpoint), so the Writer keeps
    the same checkpoints with a catalog as without one (pins in the catalog are kept too).
    ``commit_metadata`` and ``on_commit`` are ``ZephonStorageWriter``'s. One save at a time:
    wait for an ``async_save`` future before the next save.

    ``local_dir`` (a node-local path) adds the checkpoint manager's local tier: a save commits
    into ``local_dir`` and returns, and this Writer's uploader copies each checkpoint to ``url``
    in the background, in step order, through the one save path (``local_num_to_keep`` and
    ``max_pending_uploads`` mean what the manager's config keys do). ``wait_uploads`` waits
    for them and raises every upload failure; ``close`` waits too. With ``local_dir`` the
    Writer is a collective object: construct it on every rank at the same point.
    ``memory_tier=True`` adds the memory tier instead (docs/tiers.md, "The memory tier"): a
    save commits into host memory (``memory_dir``, default /dev/shm/zephon) on every node,
    each node's part is copied to ``memory_replicas`` peer nodes and uploaded to ``url`` in
    the background; collective too. ``dedup=True`` stores the shards as content-addressed
    chunks and uploads only those the previous checkpoint does not hold (docs/dedup.md); with
    a tier, its uploader does so for the copy to ``url``. ``dedup_scope="save_dir"`` keeps
    them in ``<save_dir>/_chunks/``, shared by every run (not with a tier).

    Failures: plain ``dcp.save`` raises DCP's ``CheckpointException`` (a BaseException) whose
    ``failures`` hold Zephon's errors; ``zephon.dcp.save``/``async_save`` raise Zephon's error
    itself, or use ``zephon.dcp.as_zephon_error``. The save of a failed call is marked failed
    and its files removed right away by ``zephon.dcp.save``/``async_save``, otherwise when the
    Writer next saves or closes (or by ``zephon gc``); no marker is written for it, unless the
    marker request's outcome is unknown, and then its files are kept (docs/fencing.md).
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        step: int | None = None,
        catalog: CatalogArg = None,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        num_to_keep: int | None = None,
        keep_every_steps: int | None = None,
        thread_count: int = 4,
        subdir: str = "",
        commit_metadata: CommitMetadata | None = None,
        on_commit: Callable[[Manifest], None] | None = None,
        local_dir: str | os.PathLike | None = None,
        local_num_to_keep: int = 1,
        max_pending_uploads: int = 2,
        resume_step: int | None = None,
        memory_tier: bool = False,
        memory_dir: str | os.PathLike | None = None,
        memory_num_to_keep: int = 1,
        memory_replicas: int = 1,
        dedup: bool = False,
        dedup_scope: str = "run",
    ) -> None:
        StorageWriter.__init__(self)  # ZephonStorageWriter's own __init__ needs a bound writer
        self.target = parse_run_url(url, "Writer")
        self._next_step = check_step(step, "Writer")
        #: the step this job resumed from, if it says so (None: it continues the latest)
        self.resume_step = check_resume_step("Writer", resume_step)
        retention = Retention.checked("Writer", num_to_keep, keep_every_steps)
        catalog = resolve_catalog(catalog, "Writer")
        if not isinstance(dedup, bool):
            raise invalid_option("Writer.dedup", dedup, "use True or False")
        tier = None
        if local_dir is not None or memory_tier is not False:
            tier = TierConfig(
                local_dir=os.fspath(local_dir) if isinstance(local_dir, os.PathLike) else local_dir,
                local_num_to_keep=local_num_to_keep,
                max_pending_uploads=max_pending_uploads,
                save_dir=self.target.root,
                prefix="Writer",
                memory_tier=memory_tier,
                memory_dir=os.fspath(memory_dir)
                if isinstance(memory_dir, os.PathLike)
                else memory_dir,
                memory_num_to_keep=memory_num_to_keep,
                memory_replicas=memory_replicas,
                dedup=dedup,
            )
            if dedup and dedup_scope == "save_dir":
                raise invalid_option(
                    "Writer.dedup_scope",
                    dedup_scope,
                    'a tier\'s uploads keep chunks per run in this version: use "run"',
                )
        #: coordinator, with ``dedup``: the manifest this Writer committed last (the base)
        self._last_manifest: Manifest | None = None
        try:
            self._configure(
                subdir,
                thread_count,
                commit_metadata,
                on_commit,
                # a tier keeps plain files; its uploader deduplicates the copy to url
                self._dedup_base if dedup and tier is None else None,
                dedup_scope,
            )
        except ValueError as exc:
            raise ConfigError(f"Writer: {exc}") from None
        self.num_to_keep = retention.num_to_keep
        self.keep_every_steps = retention.keep_every_steps
        self.store = CheckpointStore(self.target.root, storage_options, retry=retry)
        self.location = RunLocation(self.target.run, self.store, self.target.run)
        self.writer: CheckpointWriter | None = None  # type: ignore[assignment]
        self._save: Save | None = None
        #: coordinator: the steps this Writer committed, in order (with ``local_dir``: into
        #: the local tier; their uploads follow)
        self.committed_steps: list[int] = []
        self._started = time.monotonic()
        #: with ``local_dir``: the Writer's own process group (the local tier's collectives)
        self._coll = Collectives() if tier is not None else None
        #: the run session: the catalog (coordinator), the run's row, the attempt, retention
        self.session = RunSession(
            self.location,
            catalog=catalog,
            retention=retention,
            resume_step=self.resume_step,
            is_main=self._coll.is_main if self._coll is not None else True,
        )
        try:
            #: where saves go: ``url`` directly, or ``local_dir`` first (``zephon.destinations``)
            self.destination: Destination = self.session.open_destination(tier, self._coll)
        except BaseException:
            self.session.close()
            if self._coll is not None:
                self._coll.destroy()
            self.store.close()
            raise

    @property
    def attempt(self) -> Attempt | None:
        """Coordinator: the job's attempt, registered by the first save."""
        return self.session.attempt

    # -- identity -------------------------------------------------------------------------

    @property
    def step(self) -> int | None:
        """The step the next (or running) save writes."""
        return self._next_step

    @property
    def run(self) -> str:
        return self.target.run

    @property
    def url(self) -> str:  # type: ignore[override]
        """The checkpoint's URL (the run's while no step is set), credentials masked."""
        if self._next_step is None:
            return self.store.location.display(self.store.run(self.run).run_path())
        return self.store.run(self.run).checkpoint_url(self._next_step)

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.url

    def storage_meta(self) -> StorageMeta | None:
        save_id = self.writer.save_id if self.writer is not None else None
        return StorageMeta(checkpoint_id=self.url, save_id=save_id)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """DCP calls this with the ``checkpoint_id`` given to ``dcp.save``: the next save writes
        the step it names (``<url>/save-<step>``)."""
        if checkpoint_id is not None:
            self._next_step = step_of_checkpoint_id(
                checkpoint_id, self.target, self.store, "Writer"
            )

    # -- planning (DCP: every rank set_up + prepare_local_plan, coordinator global plan) -----

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._settle_unfinished(None)
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.destination.before_save()  # a stale attempt stops here; else backpressure
        self.writer = None
        self.manifest = None
        if not kwargs.get("use_collectives", True):
            raise WriterSetupError(
                f"saving {self.url} without collectives (use_collectives=False) would make every "
                "rank commit on its own; Zephon commits once, on the coordinator: use the default"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        wants = _RankWants(
            self.rank, self.store.location.canonical_url, self.run, self._next_step, self.url
        )
        return dataclasses.replace(plan, storage_data=wants)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: check that every rank writes this checkpoint, then begin the save
        (registering the job's attempt on the first one). Runs before any rank writes."""
        mine = (self.store.location.canonical_url, self.run, self._next_step)
        wrong = []
        for i, plan in enumerate(plans):
            wants = plan.storage_data
            if not isinstance(wants, _RankWants):
                wrong.append(f"rank {i} does not use zephon.dcp.Writer")
            elif (wants.root, wants.run, wants.step) != mine:
                wrong.append(f"rank {i} writes {_shown(wants.url, wants.step)}")
        if wrong:
            raise WriterSetupError(
                f"ranks disagree on the checkpoint to write: the coordinator writes "
                f"{_shown(self.url, self._next_step)}, but {'; '.join(wrong)}: construct the "
                "Writer with the same url and step on every rank, or pass the same checkpoint_id"
            )
        step = self._next_step
        if step is None:
            raise WriterSetupError(
                f"no step to save under {self.url}: pass Writer(..., step=N) or "
                f"dcp.save(..., checkpoint_id='{self.url}/save-<N>')"
            )
        if step in self.committed_steps:
            raise WriterSetupError(
                f"this Writer already committed {self.url}; pass "
                f"checkpoint_id='{self.store.location.display(self.store.run(self.run).run_path())}/"
                "save-<step>' to dcp.save for the next step"
            )
        try:
            attempt = self.session.attempt_for_save()
            self._started = time.monotonic()
            self._save = self.destination.begin(attempt, step)
        except Exception as exc:
            translated = portable(exc)
            if translated is exc:
                raise
            raise translated from exc
        self.writer = self._save.writer
        save_id = self._save.save_id
        prefixes = self._file_prefixes(len(plans))
        return [
            dataclasses.replace(
                plan,
                storage_data=_SaveTarget(save_id, step, prefix.prefix, prefix.base, prefix.scope),
            )
            for plan, prefix in zip(plans, prefixes, strict=True)
        ]

    def _dedup_base(self) -> Manifest | None:
        """Coordinator: the base of a deduplicated save: the checkpoint this Writer committed
        last, else the run's latest complete one (docs/dedup.md)."""
        if self._last_manifest is None:
            self._last_manifest = self.store.run(self.target.run).latest()
        return self._last_manifest

    # -- writing and committing ----------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: attach to the coordinator's save, then write this rank's shards."""
        target = plan.storage_data
        if not isinstance(target, _SaveTarget):
            raise WriterSetupError(
                f"rank {self.rank} got no save to write into for {self.url}: the coordinator is "
                "not using zephon.dcp.Writer; use it on every rank"
            )
        try:
            if not self.is_coordinator:
                self.writer = self._attach(target)
            inner = dataclasses.replace(
                plan, storage_data=_FilePrefix(target.prefix, target.base, target.scope)
            )
            return super().write_data(inner, planner)
        except BaseException as exc:
            self._settle_unfinished(exc)
            raise
        finally:
            if not self.is_coordinator:  # its part handed in, written or not (rank 0 decides)
                self.destination.handed_in(target.step, self.writer, {}, self._started)

    def _attach(self, target: _SaveTarget) -> CheckpointWriter:
        """A secondary writer into the coordinator's save, in the destination's store."""
        return self.destination.store.run(self.run).attach(target.step, save_id=target.save_id)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank wrote: the metadata, the marker (fenced), then the
        destination records the checkpoint (the catalog row and retention, or the local
        replica and its upload)."""
        save = self._save
        if save is None:
            raise WriterSetupError(f"finish of {self.url} without a save begun on this rank")
        try:
            with fenced():
                super().finish(metadata, results)
        except BaseException as exc:
            if save.writer.manifest is not None:  # ``on_commit`` raised after the marker
                self._save = None
                self.destination.committed_then_failed(save, self._started)
            self._settle_unfinished(exc)
            _raise_translated(exc)
            raise
        self._save = None
        self._last_manifest = save.writer.manifest
        self.committed_steps.append(save.step)
        try:
            self.destination.committed(save, {}, self._started)
        except BaseException as exc:
            _raise_translated(exc)
            raise

    def apply_retention(self) -> list[int]:
        """Coordinator: the checkpoint manager's retention (``zephon.gc``): with a catalog the
        run's policy through fenced claims, without one the Writer's over storage."""
        if not self.is_coordinator:
            return []
        return self.session.retain()

    # -- failures and the end --------------------------------------------------------------

    def _save_failed(self, exc: BaseException) -> None:
        self._settle_unfinished(exc)

    def _settle_unfinished(self, exc: BaseException | None) -> None:
        """Coordinator: a save that began and never committed is marked failed and its files
        removed (``Save.failed`` never raises); the other ranks' parts, handed in as their
        write ended, are voided."""
        save, self._save = self._save, None
        self._last_manifest = None  # looked up again: the failure may be that it was deleted
        if save is not None and save.writer.manifest is None:
            self.destination.failed(save, exc or RuntimeError("the DCP save did not finish"))
            self.destination.void(save, self._started)

    def wait_uploads(self) -> None:
        """Every rank (with ``local_dir``): wait until every queued upload to ``url`` is done;
        raise every failure in one exception (``zephon.StaleAttemptError`` for a stale attempt's).
        Without ``local_dir``, nothing to wait for."""
        self.destination.wait()

    def close(self) -> None:
        """Settle an unfinished save, wait for the uploads (raising every failure, after
        everything is closed), close the destination, a catalog opened from its URL, and the
        store."""
        self._settle_unfinished(None)
        failure: BaseException | None = None
        try:
            self.destination.wait()
        except BaseException as exc:  # noqa: BLE001 - raised once everything is closed
            failure = exc
        try:
            self.session.close()
        finally:
            if self._coll is not None:
                self._coll.destroy()
                self._coll = None
            self.store.close()
        if failure is not None:
            raise failure

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise_translated(exc: BaseException) -> None:
    """Raise what the Writer raises for ``exc`` when it differs from ``exc``: Zephon's own
    error for a newer attempt's refusal, in a form DCP can carry between ranks."""
    translated = portable(as_zephon_error(exc))
    if translated is not exc:
        raise translated from exc


def _shown(url: str, step: int | None) -> str:
    return url if step is not None else f"{url} with no step"
