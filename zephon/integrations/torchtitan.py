"""torchtitan through Zephon: its checkpointer saves every ``checkpoint.interval`` step as
checkpoint ``N`` of a Zephon run (fenced, catalogued, every file with its size and CRC32C, the
marker last) and resumes from the run's latest *complete* checkpoint.

Switched on with torchtitan's own override mechanism, nothing else in the job changes::

    --override.imports zephon.integrations.torchtitan.zephon_checkpointer
    --checkpoint.enable --checkpoint.folder s3://bucket/ckpt/my-run

``checkpoint.folder`` is the run's URL, ``<save_dir>/<run>`` (any fsspec URL, or a path; a
relative one is under ``dump_folder`` as torchtitan has it). Options go with the override
target as JSON (``zephon_checkpointer={"catalog": "postgresql://...", "num_to_keep": 3,
"keep_every_steps": 1000}``), or come from ``$ZEPHON_CATALOG_URL`` and
``$ZEPHON_STORAGE_OPTIONS``.

Why: torchtitan's ``CheckpointManager`` saves with plain DCP into ``step-N`` folders, resumes from
the highest ``step-N`` that has a ``.metadata`` file (a torn save whose metadata landed looks
complete), and purges ``keep_latest_k`` folders right after an async save starts, counting the
unfinished one. Here saves and async saves go through ``zephon.dcp.Writer`` (the one save
path), the resume step is ``zephon.latest.find_latest``'s, and retention keeps ``num_to_keep``
committed checkpoints, applied after each commit. See ``docs/torchtitan.md``.

Importing this module imports torchtitan (``import zephon`` does not).
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.config.override import derive, override
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

from zephon import dcp as zd
from zephon.catalog import Catalog
from zephon.errors import ConfigError, ZephonError
from zephon.latest import find_latest
from zephon.locations import storage_options_from_env
from zephon.retention import Retention
from zephon.session import resolve_catalog
from zephon.storage import mask_url

__all__ = ["ZephonCheckpointManager", "zephon_checkpointer"]

#: who takes the options (the override's JSON), as their error messages name it
OWNER = "zephon_checkpointer"


class ZephonCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with Zephon underneath: same config, same states, same
    step schedule; what changes is where the bytes go and how the resume step is found.

    - ``dcp_save`` hands torchtitan's state dict to ``zephon.dcp.save`` / ``async_save`` with
      one ``zephon.dcp.Writer`` for the job (its first save registers the job's attempt); the
      checkpoint is ``<folder>/save-<step>``, committed by the marker written last.
    - ``_load`` takes the step from ``zephon.latest.find_latest`` (the catalog first, a
      storage scan without one), looked up on rank 0 and broadcast, and loads it through
      ``zephon.dcp.Reader``, every byte checked against its CRC32C. ``checkpoint.load_step``
      still names a step explicitly, and is the Writer's ``resume_step`` (the job resumes
      there: the run's newer checkpoints are abandoned, not mixed with the new ones);
      ``initial_load_path`` is used as torchtitan uses it when the run has no complete
      checkpoint.
    - retention: ``num_to_keep`` (else ``keep_latest_k``, 0 keeping all) newest *committed*
      checkpoints and each one whose step is a multiple of ``keep_every_steps``, applied by
      the Writer (its ``zephon.session.RunSession``) after each commit with the checkpoint
      manager's code (``zephon.gc``); torchtitan's purge thread is never started.

    ``async_mode="async_with_pinned_mem"`` runs as ``"async"`` (a background thread with
    ``zephon.dcp.ZephonStager``'s reused host buffers): DCP's process-based saver would run the
    Writer in another process, away from the attempt that fences it. ``last_save_in_hf`` is
    refused: a Zephon checkpoint is DCP.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        catalog: str | None = None
        """SQLAlchemy URL of the Zephon catalog; None: ``$ZEPHON_CATALOG_URL``, unset: storage
        alone decides (a scan)."""

        storage_options: dict[str, Any] | None = None
        """fsspec options for ``folder``; None: JSON in ``$ZEPHON_STORAGE_OPTIONS``."""

        num_to_keep: int | None = None
        """Committed checkpoints to keep; None: ``keep_latest_k`` (0 keeps every one)."""

        keep_every_steps: int | None = None
        """Also keep each checkpoint whose step is a multiple of this (milestones); None:
        none."""

        verify: bool = True
        """Check every byte read on load against its recorded CRC32C."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            Retention.checked(OWNER, self.num_to_keep, self.keep_every_steps)
            resolve_catalog(self.catalog, OWNER)
            if self.last_save_in_hf:
                raise ConfigError(
                    "checkpoint.last_save_in_hf is not supported with zephon_checkpointer: a "
                    "Zephon checkpoint is DCP; export Hugging Face weights from it after training"
                )

        def to_dict(self) -> dict:
            """torchtitan logs this dict and hands it to its metric loggers: credentials in the
            catalog URL and the storage options are masked."""
            shown = CheckpointManager.Config.to_dict(self)
            if shown.get("catalog"):
                shown["catalog"] = mask_url(shown["catalog"])
            if shown.get("storage_options"):
                shown["storage_options"] = dict.fromkeys(shown["storage_options"], "***")
            return shown

    def __init__(self, config: Config, **kwargs: Any) -> None:
        keep = config.num_to_keep
        if keep is None and config.keep_latest_k > 0:
            keep = config.keep_latest_k
        # torchtitan's purge thread counts step folders, the unfinished one included: never
        # start it; the Writer applies retention after each commit instead.
        super().__init__(dataclasses.replace(config, keep_latest_k=0), **kwargs)
        if not self.enable:
            return
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            logger.warning(
                "zephon_checkpointer runs checkpoint.async_mode=async_with_pinned_mem as 'async' "
                "(a background thread, host buffers reused from save to save)"
            )
            self.async_mode = AsyncMode.ASYNC
            if self.pg is None:
                self.pg = dist.new_group(backend="gloo")
        if not filesystem.is_remote(self.folder):
            self.folder = os.path.abspath(self.folder)
        self.folder = self.folder.rstrip("/")
        self.retention = Retention.checked(OWNER, keep, config.keep_every_steps)
        self.num_to_keep: int | None = keep
        resolved = resolve_catalog(config.catalog, OWNER)
        self.catalog_url: str | None = resolved if isinstance(resolved, str) else None
        self.storage_options: dict[str, Any] = storage_options_from_env(config.storage_options)
        self.verify = config.verify
        # An explicit checkpoint.load_step is where this job resumes: the Writer's attempt
        # abandons the run's newer history; without it, a save below the latest is refused.
        load_step = getattr(config, "load_step", -1)
        self.writer = zd.Writer(
            self.folder,
            catalog=self.catalog_url,
            storage_options=self.storage_options,
            num_to_keep=keep,
            keep_every_steps=config.keep_every_steps,
            resume_step=load_step if isinstance(load_step, int) and load_step >= 0 else None,
        )
        self.zephon_stager: zd.ZephonStager | None = None
        logger.info(
            f"Zephon checkpoints: run {self.writer.run!r} at {self.writer.url}, "
            f"catalog {mask_url(self.catalog_url) if self.catalog_url else 'none (storage scan)'}, "
            f"keeping {keep if keep is not None else 'every'} committed checkpoint(s)"
            + (
                f" and every multiple of step {config.keep_every_steps}"
                if config.keep_every_steps is not None
                else ""
            )
        )

    # -- where checkpoints are -------------------------------------------------------------

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """``<folder>/save-<step>``: the Zephon checkpoint of ``step`` in this run."""
        return f"{(folder or self.folder).rstrip('/')}/save-{step}"

    def _is_own(self, checkpoint_id: str) -> bool:
        return checkpoint_id.startswith(f"{self.folder}/save-")

    def latest_step(self) -> int | None:
        """The run's latest complete checkpoint step (``zephon.latest.find_latest``), or None.
        Rank 0 looks it up (the catalog may repair rows on the way) and broadcasts it; a failed
        lookup raises on every rank (rank 0 its own error), instead of leaving them waiting."""
        found: list[Any] = [None, None]  # step, the failure on rank 0
        failure: BaseException | None = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            catalog = None
            try:
                catalog = Catalog(self.catalog_url) if self.catalog_url else None
                latest = find_latest(self.writer.location, catalog=catalog, confirm=True)
                found[0] = latest.step if latest is not None else None
            except Exception as exc:
                failure = exc
                found[1] = f"{type(exc).__name__}: {exc}"
            finally:
                if catalog is not None:
                    catalog.close()
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0, group=self.pg)
        if failure is not None:
            raise failure
        if found[1] is not None:
            raise ZephonError(
                f"rank 0 could not find the latest checkpoint of {mask_url(self.folder)}: "
                f"{found[1]}"
            )
        return found[0]

    def _find_load_step(self, folder: str = "") -> int:
        """The latest complete checkpoint's step, -1 for none (torchtitan lists ``step-N``)."""
        if folder and folder.rstrip("/") != self.folder:
            return super()._find_load_step(folder)
        step = self.latest_step()
        return -1 if step is None else step

    # -- save ------------------------------------------------------------------------------

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future | None:
        """Save ``state_dict`` as ``checkpoint_id`` (``<folder>/save-<step>``) through the
        job's ``zephon.dcp.Writer``: committed on return, or (``async``) when the returned
        future completes, which raises the save's error if it failed."""
        if to_hf or not self._is_own(checkpoint_id):
            raise ConfigError(
                f"zephon_checkpointer saves only Zephon checkpoints of {mask_url(self.folder)}, "
                f"not {mask_url(checkpoint_id)}{' in Hugging Face format' if to_hf else ''}"
            )
        ret: Future | None = None
        if async_mode == AsyncMode.DISABLED:
            zd.save(state_dict, self.writer, checkpoint_id=checkpoint_id)
        else:
            if self.zephon_stager is None:
                self.zephon_stager = zd.ZephonStager()
            ret = zd.async_save(
                state_dict,
                self.writer,
                process_group=self.pg,
                stager=self.zephon_stager,
                checkpoint_id=checkpoint_id,
            )
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: the Writer applies ``num_to_keep`` after each commit."""

    # -- load ------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step``, or (-1) the run's latest complete checkpoint; without one, torchtitan's
        own initial load (``initial_load_path``, HF assets) or a fresh start."""
        if step == -1:
            latest = self.latest_step()
            if latest is None:
                if self.initial_load_path or self.initial_load_in_hf:
                    return super()._load(-1)
                logger.info(
                    f"No complete Zephon checkpoint in {mask_url(self.folder)}: a fresh start."
                )
                return False
            step = latest
        checkpoint_id = self._create_checkpoint_id(step)
        logger.info(f"Loading the Zephon checkpoint {mask_url(checkpoint_id)}.")
        begin = time.monotonic()
        states = self._states_to_load(model_only=step == 0)
        self.dcp_load(states, checkpoint_id=checkpoint_id, from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        logger.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """A checkpoint of this run through ``zephon.dcp.Reader`` (verified); anything else
        (``initial_load_path``, HF weights) as torchtitan loads it."""
        if from_hf or not self._is_own(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        with zd.Reader(
            self.folder, storage_options=self.storage_options, verify=self.verify
        ) as reader:
            zd.load(state_dict, reader, checkpoint_id=checkpoint_id)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    # -- the end ---------------------------------------------------------------------------

    def _close(self) -> None:
        """Wait for an async save in flight, then release the stager, the Writer and
        torchtitan's own resources."""
        if not hasattr(self, "writer"):  # __init__ failed before the Writer existed
            super()._close()
            return
        try:
            if self.save_future is not None:
                self.save_future.result()
                self.save_future = None
        finally:
            if self.zephon_stager is not None:
                self.zephon_stager.close()
                self.zephon_stager = None
            self.writer.close()
            super()._close()


@override(
    target=CheckpointManager.Config,
    exact=True,
    description="Zephon checkpoints: the one save path, the latest complete checkpoint",
)
def zephon_checkpointer(
    cfg: CheckpointManager.Config,
    *,
    catalog: str | None = None,
    storage_options: dict[str, Any] | None = None,
    num_to_keep: int | None = None,
    keep_every_steps: int | None = None,
    verify: bool = True,
) -> ZephonCheckpointManager.Config:
    """The torchtitan override that switches Zephon on
    (``--override.imports zephon.integrations.torchtitan.zephon_checkpointer``): replaces the
    job's ``CheckpointManager`` config with ``ZephonCheckpointManager``'s, every
    ``checkpoint.*`` setting carried over. Keyword arguments come from the target's JSON."""
    return derive(
        cfg,
        ZephonCheckpointManager.Config,
        catalog=catalog,
        storage_options=storage_options,
        num_to_keep=num_to_keep,
        keep_every_steps=keep_every_steps,
        verify=verify,
    )
