"""``zephon.dcp.Writer``: a drop-in DCP storage writer addressed by URL.

``dcp.save(sd, storage_writer=Writer("s3://bucket/ckpt/run", step=100))`` on every rank writes
checkpoint ``s3://bucket/ckpt/run/save-100`` through the project's one save path: the
coordinator registers the job's attempt on the Writer's first save (``zephon.attempts``), begins
the save with ``zephon.saving.Save`` (catalog row ``pending``, fenced storage ``begin``) while DCP
plans, so before any rank writes; the save id travels to the other ranks inside the plan. Every
rank then writes its shards with ``ZephonStorageWriter``'s code; ``finish`` commits the marker,
records the row ``committed`` and applies retention with the code the checkpoint manager uses.
See "Drop-in writer and reader" in ``docs/dcp.md``.
"""

from __future__ import annotations

import contextlib
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

from catalog import Catalog
from storage import (
    CheckpointStore,
    CheckpointWriter,
    Manifest,
    RetryPolicy,
    mask_url,
    parse_step_dirname,
    validate_run,
    validate_step,
)
from zephon.attempts import Attempt, fenced, register_writer
from zephon.checkpointing.collectives import Collectives
from zephon.checkpointing.tiering import Tiering
from zephon.checkpointing.uploader import UploadJob
from zephon.config import CheckpointingConfig
from zephon.dcp.errors import WriterSetupError, portable
from zephon.dcp.writer import CommitMetadata, ZephonStorageWriter, _FilePrefix
from zephon.errors import ConfigError, as_zephon_error
from zephon.gc import apply_retention
from zephon.locations import RunLocation
from zephon.outage import close_guard, ensure_run, open_catalog
from zephon.saving import Save

__all__ = ["RunURL", "Writer", "parse_run_url"]

CatalogArg = Catalog | str | None


@dataclass(frozen=True, slots=True)
class RunURL:
    """``<save_dir>/<run>`` split: the store's root as given, and the run name."""

    given: str
    root: str
    run: str


def parse_run_url(url: str | os.PathLike, what: str) -> RunURL:
    """Split a Writer's or Reader's ``url`` into its save_dir and run (the last component);
    a one-line ``ConfigError`` naming the URL (credentials masked) and the fix otherwise."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(
            f"{what} url = {url!r} is invalid: give the run's URL, <save_dir>/<run>, e.g. "
            "'s3://bucket/ckpt/my-run' or '/data/ckpt/my-run'"
        )
    given = url.rstrip("/")
    root, sep, run = given.rpartition("/")
    if not sep or not root or root.endswith(":/") or root.endswith(":"):
        raise ConfigError(
            f"{what} url {mask_url(url)!r} has no run component: give <save_dir>/<run>, e.g. "
            f"'{mask_url(given)}/my-run'"
        )
    try:
        validate_run(run)
    except ValueError:
        raise ConfigError(
            f"{what} url {mask_url(url)!r}: its last component {run[:60]!r} is not a valid run "
            "name (1-128 of A-Z a-z 0-9 . _ -, not a step directory like 'save-5'): give "
            "<save_dir>/<run>"
        ) from None
    return RunURL(given, root, run)


def check_step(step: Any, what: str, name: str = "step") -> int | None:
    """``step`` as given to a Writer or Reader (its argument ``name``): None, or a step
    number."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError(f"{what} {name} = {step!r} is invalid: give an integer >= 0, or None")
    try:
        return validate_step(step)
    except ValueError as exc:
        raise ConfigError(f"{what} {name} = {step!r} is invalid: {exc}") from None


def step_of_checkpoint_id(
    checkpoint_id: str | os.PathLike, url: RunURL, store: CheckpointStore, what: str
) -> int:
    """The step a ``checkpoint_id`` names: ``<run url>/save-<step>`` (also in the store's own
    path form). Anything else is refused, naming what this object is bound to."""
    given = os.fspath(checkpoint_id).rstrip("/") if checkpoint_id is not None else ""
    parent, _, last = given.rpartition("/")
    step = parse_step_dirname(last)
    run_forms = {
        url.given,
        store.run(url.run).run_path().rstrip("/"),
        store.location.display(store.run(url.run).run_path()).rstrip("/"),
    }
    if step is None or parent not in run_forms:
        shown = mask_url(given) if "://" in given else given
        raise WriterSetupError(
            f"checkpoint_id {shown!r} is not a checkpoint of this {what}'s run "
            f"{mask_url(url.given)}: pass checkpoint_id='{mask_url(url.given)}/save-<step>', or "
            f"make a {what} for the other run"
        )
    return step


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

    ``catalog`` (a ``catalog.Catalog`` or its URL, opened on the coordinator only) records every
    save; ``num_to_keep`` keeps that many newest checkpoints (with a catalog it is stored as the
    run's policy, and the catalog's retention applies whatever policy the run has).
    ``commit_metadata`` and ``on_commit`` are ``ZephonStorageWriter``'s. One save at a time:
    wait for an ``async_save`` future before the next save.

    ``local_dir`` (a node-local path) adds the checkpoint manager's local tier: a save commits
    into ``local_dir`` and returns, and this Writer's uploader copies each checkpoint to ``url``
    in the background, in step order, through the one save path (``local_num_to_keep`` and
    ``max_pending_uploads`` mean what the manager's config keys do). ``wait_uploads`` waits
    for them and raises every upload failure; ``close`` waits too. With ``local_dir`` the
    Writer is a collective object: construct it on every rank at the same point.

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
        thread_count: int = 4,
        subdir: str = "",
        commit_metadata: CommitMetadata | None = None,
        on_commit: Callable[[Manifest], None] | None = None,
        local_dir: str | os.PathLike | None = None,
        local_num_to_keep: int = 1,
        max_pending_uploads: int = 2,
        resume_step: int | None = None,
    ) -> None:
        StorageWriter.__init__(self)  # ZephonStorageWriter's own __init__ needs a bound writer
        self.target = parse_run_url(url, "Writer")
        self._next_step = check_step(step, "Writer")
        #: the step this job resumed from, if it says so (None: it continues the latest)
        self.resume_step = check_step(resume_step, "Writer", "resume_step")
        if num_to_keep is not None and (
            isinstance(num_to_keep, bool) or not isinstance(num_to_keep, int) or num_to_keep < 1
        ):
            raise ConfigError(
                f"Writer num_to_keep = {num_to_keep!r} is invalid: give an integer >= 1, or None "
                "to keep every checkpoint"
            )
        if catalog is not None and not isinstance(catalog, Catalog | str):
            raise ConfigError(
                f"Writer catalog must be a catalog.Catalog or its URL, got {type(catalog).__name__}"
            )
        try:
            self._configure(subdir, thread_count, commit_metadata, on_commit)
        except ValueError as exc:
            raise ConfigError(f"Writer: {exc}") from None
        self.num_to_keep = num_to_keep
        self.store = CheckpointStore(self.target.root, storage_options, retry=retry)
        self.location = RunLocation(self.target.run, self.store, self.target.run)
        self._catalog_arg = catalog
        self._catalog: Catalog | None = catalog if isinstance(catalog, Catalog) else None
        self._catalog_ready = False
        self.writer: CheckpointWriter | None = None  # type: ignore[assignment]
        #: coordinator: the job's attempt, registered by the first save
        self.attempt: Attempt | None = None
        self._save: Save | None = None
        #: coordinator: the steps this Writer committed, in order (with ``local_dir``: into
        #: the local tier; their uploads follow)
        self.committed_steps: list[int] = []
        self._started = time.monotonic()
        #: the local tier and its uploader (``local_dir``), shared with the checkpoint manager
        self.tiering: Tiering | None = None
        self._coll: Collectives | None = None
        if local_dir is not None:
            self._set_up_tier(local_dir, local_num_to_keep, max_pending_uploads)

    def _set_up_tier(self, local_dir: str | os.PathLike, keep: int, max_pending: int) -> None:
        """Every rank: the manager's local tier (``Tiering``) for this Writer's run, checked
        as the manager's config keys are; the catalog is opened on rank 0 (it records the
        replicas)."""
        config = CheckpointingConfig(
            save_dir=self.target.root,
            local_dir=os.fspath(local_dir) if isinstance(local_dir, os.PathLike) else local_dir,
            num_to_keep=self.num_to_keep,
            local_num_to_keep=keep,
            max_pending_uploads=max_pending,
            prefix="Writer",
        )
        coll = Collectives()

        def open_catalog_on_main() -> None:
            self._open_catalog()

        try:
            coll.from_main(open_catalog_on_main, "open the catalog")
            self.tiering = Tiering(
                config,
                coll,
                self.location,
                self._catalog if coll.is_main else None,
                attempt=self._tier_attempt,
                retain=self.apply_retention,
            )
        except BaseException:
            coll.destroy()
            self.store.close()
            raise
        self._coll = coll

    def _tier_attempt(self) -> Attempt:
        """The uploader's (rank 0) attempt: the one this Writer's first save registered."""
        if self.attempt is None:
            raise WriterSetupError(f"no attempt registered for {self.url}: save first")
        return self.attempt

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
        if self.tiering is not None:
            self.tiering.before_save()  # a stale attempt stops here; else backpressure
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
            catalog = self._open_catalog()
            attempt = self._current_attempt(catalog)
            self._started = time.monotonic()
            if self.tiering is not None:
                self._save = self.tiering.begin(attempt, step)
            else:
                self._save = Save.begin(attempt, step, catalog=catalog)
        except Exception as exc:
            translated = portable(exc)
            if translated is exc:
                raise
            raise translated from exc
        self.writer = self._save.writer
        save_id = self._save.save_id
        return [
            dataclasses.replace(plan, storage_data=_SaveTarget(save_id, step, f"__{i}_"))
            for i, plan in enumerate(plans)
        ]

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
            inner = dataclasses.replace(plan, storage_data=_FilePrefix(target.prefix))
            return super().write_data(inner, planner)
        except BaseException as exc:
            self._settle_unfinished(exc)
            raise
        finally:
            if self.tiering is not None and not self.is_coordinator:
                self._queue_upload(target.step)

    def _queue_upload(self, step: int) -> None:
        """A non-coordinator rank of a tiered save, its write done (or failed): queue its part
        of the upload. Its uploader waits in the upload's first collective for rank 0, which
        queues the step once the local marker is committed (or a void job if it never is)."""
        writer = self.writer
        own = list(writer.entries) if writer is not None else []
        payload = writer.payload_path if writer is not None else ""
        save_id = writer.save_id if writer is not None else ""
        assert self.tiering is not None
        self.tiering.uploader.submit(UploadJob(step, payload, own, {}, self._started, save_id))

    def _attach(self, target: _SaveTarget) -> CheckpointWriter:
        """A secondary writer into the coordinator's save (the local tier's, with one)."""
        store = self.tiering.store if self.tiering is not None else self.store
        return store.run(self.run).attach(target.step, save_id=target.save_id)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank wrote: the metadata, the marker (fenced), the catalog
        row, then retention."""
        save = self._save
        if save is None:
            raise WriterSetupError(f"finish of {self.url} without a save begun on this rank")
        try:
            with fenced():
                super().finish(metadata, results)
            if self.tiering is None:
                save.committed()
        except BaseException as exc:
            if self.tiering is not None and save.writer.manifest is not None:
                # the local marker is committed (``on_commit`` raised after it): a checkpoint,
                # uploaded like any other; the other ranks queued their part already
                self._save = None
                self.tiering.committed(save.step, save, save.writer, {}, self._started)
            self._settle_unfinished(exc)
            translated = portable(as_zephon_error(exc))
            if translated is not exc:
                raise translated from exc
            raise
        self._save = None
        self.committed_steps.append(save.step)
        if self.tiering is not None:
            # the local replica recorded, the upload queued; save_dir retention follows it
            self.tiering.committed(save.step, save, save.writer, {}, self._started)
        else:
            self.apply_retention()

    def apply_retention(self) -> list[int]:
        """Coordinator: the checkpoint manager's retention (``zephon.gc``): with a catalog the
        run's policy through fenced claims, without one ``num_to_keep`` over storage."""
        attempt = self.attempt
        if attempt is None or not self.is_coordinator:
            return []
        return apply_retention(self.location, self._catalog, attempt.fence, self.num_to_keep)

    # -- failures and the end --------------------------------------------------------------

    def _save_failed(self, exc: BaseException) -> None:
        self._settle_unfinished(exc)

    def _settle_unfinished(self, exc: BaseException | None) -> None:
        """Coordinator: a save that began and never committed is marked failed and its files
        removed (``Save.failed`` never raises)."""
        save, self._save = self._save, None
        if save is not None and save.writer.manifest is None:
            exc = exc or RuntimeError("the DCP save did not finish")
            save.failed(exc)
            if self.tiering is not None:
                self.tiering.failed(save, exc)
                # the other ranks queued their part as their write ended: keep them in step
                job = UploadJob(save.step, "", [], {}, self._started, save.save_id, void=True)
                self.tiering.uploader.submit(job)

    def _open_catalog(self) -> Catalog | None:
        """Coordinator: the catalog (opened from its URL here, once) with this run in it."""
        if self._catalog_arg is None:
            return None
        if self._catalog is None:
            self._catalog = open_catalog(self._catalog_arg)  # type: ignore[arg-type]
        if not self._catalog_ready:
            catalog = self._catalog
            given = {"num_to_keep": self.num_to_keep} if self.num_to_keep is not None else {}
            ensure_run(
                catalog,
                self.location,
                lambda: catalog.ensure_run(
                    self.run, self.store.location.canonical_url, status="active", **given
                ),
            )
            self._catalog_ready = True
        return self._catalog

    def _current_attempt(self, catalog: Catalog | None) -> Attempt:
        """The job's attempt, registered on the first save: resuming from ``resume_step``, or
        continuing the run's latest complete checkpoint (a save below it is then refused)."""
        if self.attempt is None:
            self.attempt = register_writer(self.location, catalog, resume_step=self.resume_step)
        return self.attempt

    def wait_uploads(self) -> None:
        """Every rank (with ``local_dir``): wait until every queued upload to ``url`` is done;
        raise every failure in one exception (``zephon.StaleAttemptError`` for a stale attempt's).
        Without ``local_dir``, nothing to wait for."""
        if self.tiering is not None:
            self.tiering.wait()

    def close(self) -> None:
        """Settle an unfinished save, wait for the uploads (raising every failure, after
        everything is closed), close a catalog opened from its URL, and the store."""
        self._settle_unfinished(None)
        failure: BaseException | None = None
        if self.tiering is not None:
            try:
                self.tiering.wait()
            except BaseException as exc:  # noqa: BLE001 - raised once everything is closed
                failure = exc
            self.tiering.close()
            self.tiering = None
            if self._coll is not None:
                self._coll.destroy()
                self._coll = None
        self._close_rest()
        if failure is not None:
            raise failure

    def _close_rest(self) -> None:
        if self._catalog is not None and isinstance(self._catalog_arg, str):
            close_guard(self._catalog)
            with contextlib.suppress(Exception):
                self._catalog.close()
            self._catalog = None
        self.store.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shown(url: str, step: int | None) -> str:
    return url if step is not None else f"{url} with no step"
