"""The Hugging Face ``Trainer`` through Zephon: every ``checkpoint-N`` folder the Trainer writes
becomes checkpoint ``N`` of a Zephon run (fenced, catalogued, every file with its size and
CRC32C, the marker last), and ``latest_checkpoint`` answers ``resume_from_checkpoint`` with a
local folder holding the latest *complete* one.

Why: the Trainer's own ``resume_from_checkpoint=True`` takes the highest ``checkpoint-N`` in
``output_dir`` without checking it is complete, so a job killed while saving crashes on restart
(``FileNotFoundError`` for ``trainer_state.json``), and its checkpoints live only where the job
ran. Here a save either committed, with every byte recorded, or does not exist; and the callback
makes the stock ``resume_from_checkpoint=True`` agree: when the Trainer is made
(``on_init_end``, the one hook before ``train()`` resolves ``True`` with
``get_last_checkpoint(output_dir)``) it puts the run's latest complete checkpoint at
``output_dir/checkpoint-N`` and moves every newer ``checkpoint-M`` folder, which Zephon never
committed, aside into ``output_dir/.zephon-incomplete/``.

Importing this module imports transformers (``import zephon`` does not).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from transformers import TrainerCallback

from zephon.errors import ConfigError
from zephon.integrations.accelerate import FolderCheckpoints
from zephon.integrations.download import Fetched, fetch_latest, record_save
from zephon.retention import Retention, RetentionOptions, check_resume_step
from zephon.session import CatalogArg, resolve_catalog
from zephon.storage import InvalidNameError, validate_run

__all__ = [
    "ZephonCallback",
    "latest_checkpoint",
    "prepare_output_dir",
    "remove_temporary_downloads",
]

log = logging.getLogger("zephon")

#: who takes the callback's options, as its error messages name it
OWNER = "ZephonCallback"
#: where uncommitted ``checkpoint-N`` folders of ``output_dir`` are moved: neither
#: ``get_last_checkpoint`` nor the Trainer's rotation (``checkpoint-*``) looks inside
INCOMPLETE = ".zephon-incomplete"
#: the Trainer's folder names (transformers' ``_re_checkpoint``)
_CHECKPOINT_FOLDER = re.compile(r"^checkpoint-(\d+)$")
#: temporary downloads ``latest_checkpoint`` made in this process, removed when training ends
_temporary: list[Fetched] = []
_temporary_lock = threading.Lock()


def remove_temporary_downloads() -> None:
    """Remove the private temporary folders ``latest_checkpoint`` downloaded into (without
    ``local_dir``): ``ZephonCallback`` does at ``on_train_end``, and this process at exit."""
    with _temporary_lock:
        done, _temporary[:] = list(_temporary), []
    for fetched in done:
        fetched.remove()


atexit.register(remove_temporary_downloads)


def latest_checkpoint(
    save_dir: str,
    run_name: str,
    *,
    catalog: CatalogArg = None,
    storage_options: Mapping[str, Any] | None = None,
    local_dir: str | None = None,
) -> str | None:
    """A local folder holding the run's latest complete checkpoint, to pass as
    ``trainer.train(resume_from_checkpoint=...)``; None when the run has none (a fresh start).

    ``save_dir`` is a path or any fsspec URL (``s3://bucket/prefix``); ``catalog`` a ``Catalog``,
    a SQLAlchemy URL, or None for ``$ZEPHON_CATALOG_URL`` (unset: storage alone decides). On
    local disk the checkpoint is verified in place; elsewhere (or with ``local_dir``) it is
    downloaded, every file checked against its CRC32C as it arrives: to
    ``<local_dir>/checkpoint-<step>`` (a folder there that holds this save already is checked
    again, file by file, and cleared of files its manifest does not list before it is reused),
    or without ``local_dir`` to a fresh private temporary directory, removed when training ends
    (``ZephonCallback.on_train_end``) or at the latest when this process exits. A damaged
    checkpoint is quarantined and the next complete one taken. Under ``torch.distributed``
    call it on every process: one process per host downloads, the others use its folder."""
    found = fetch_latest(
        save_dir,
        run_name,
        catalog=resolve_catalog(catalog, "latest_checkpoint"),
        storage_options=storage_options,
        local_dir=local_dir,
    )
    if found is None:
        return None
    if found.temporary is not None:
        with _temporary_lock:
            _temporary.append(found)
    return found.folder


def prepare_output_dir(
    output_dir: str,
    save_dir: str,
    run_name: str,
    *,
    catalog: CatalogArg = None,
    storage_options: Mapping[str, Any] | None = None,
) -> int | None:
    """Make ``get_last_checkpoint(output_dir)`` name the run's latest complete checkpoint (every
    process; collective under torch.distributed), and return its step (None: the run has none).

    The checkpoint is materialised as ``output_dir/checkpoint-<step>`` like ``latest_checkpoint``
    does into a ``local_dir`` (a folder there holding this very save is re-verified and reused;
    the Trainer's own folder of that step is replaced by the verified copy), and every
    ``checkpoint-M`` above it is moved into ``output_dir/.zephon-incomplete/``: a save killed
    half-written, or one Zephon never committed. Nothing is deleted."""
    found = fetch_latest(
        save_dir, run_name, catalog=catalog, storage_options=storage_options, local_dir=output_dir
    )
    step = None if found is None else found.step
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return step
    for name in names:
        match = _CHECKPOINT_FOLDER.match(name)
        folder = os.path.join(output_dir, name)
        if match is None or (step is not None and int(match[1]) <= step):
            continue
        if not os.path.isdir(folder):
            continue
        aside = os.path.join(output_dir, INCOMPLETE, f"{name}.{time.time_ns()}-{os.getpid()}")
        os.makedirs(os.path.dirname(aside), exist_ok=True)
        try:
            os.rename(folder, aside)
        except FileNotFoundError:
            continue  # another process of this host moved it first
        log.warning(
            "zephon: %s is not a complete checkpoint of run %r (the latest is %s): moved to %s "
            "so that resume_from_checkpoint=True skips it",
            folder,
            run_name,
            "none" if step is None else f"step {step}",
            aside,
        )
    return step


class ZephonCallback(TrainerCallback, RetentionOptions):
    """A ``TrainerCallback`` that commits every ``checkpoint-N`` the Trainer saves as checkpoint
    ``N`` of run ``run_name`` under ``save_dir`` (a path or fsspec URL).

    At ``on_train_begin`` it notes the step the Trainer resumed from; the first ``on_save``
    registers this job's attempt, resuming from it (or from ``resume_step``; 0 starts over and
    abandons the run's older history), and an older attempt of the run still running is fenced
    out from then on. A Trainer that resumed from nothing and no ``resume_step`` continues the
    run's latest checkpoint: a save below it is refused (``zephon.SaveBelowLatestError``), since
    such a job started over by mistake. At ``on_save`` (every process) the folder is uploaded
    and committed; ``num_to_keep`` deletes the oldest afterwards, except each checkpoint whose
    step is a multiple of ``keep_every_steps`` (the Trainer's ``save_total_limit`` only prunes
    the local ``output_dir``). ``catalog``: a ``catalog.Catalog`` or its URL, else
    ``$ZEPHON_CATALOG_URL`` (unset: storage alone). ``run_name`` defaults to
    ``args.run_name``, else the last component of ``args.output_dir``. Every option is checked
    here, at construction (``zephon.retention``). At ``on_init_end`` (the Trainer's
    construction, every process) it runs ``prepare_output_dir``, so the Trainer's own
    ``resume_from_checkpoint=True`` resumes from the run's latest complete checkpoint, even on a
    machine whose ``output_dir`` is empty; pass the callback in ``Trainer(callbacks=[...])``,
    since ``add_callback`` comes after that hook.
    """

    def __init__(
        self,
        save_dir: str,
        run_name: str | None = None,
        *,
        catalog: CatalogArg = None,
        storage_options: Mapping[str, Any] | None = None,
        num_to_keep: int | None = None,
        keep_every_steps: int | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.retention = Retention.checked(OWNER, num_to_keep, keep_every_steps)
        self.resume_step = check_resume_step(OWNER, resume_step)
        self.catalog = resolve_catalog(catalog, OWNER)
        self.save_dir = save_dir
        self.run_name = run_name
        self.storage_options = dict(storage_options or {})
        self.folders: FolderCheckpoints | None = None

    def _run_name(self, args: Any) -> str:
        if self.run_name is not None:
            return self.run_name
        candidate = getattr(args, "run_name", None) or os.path.basename(
            os.path.normpath(args.output_dir)
        )
        try:
            validate_run(candidate or "")
        except InvalidNameError:
            raise ConfigError(
                f"ZephonCallback cannot use {str(candidate)[:120]!r} as the run name: pass "
                "run_name='my-run' (1-128 of A-Za-z0-9._-, not save-<step> or _attempts)"
            ) from None
        return candidate

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not args.output_dir:  # nothing for get_last_checkpoint to look in
            return
        prepare_output_dir(
            args.output_dir,
            self.save_dir,
            self._run_name(args),
            catalog=self.catalog,
            storage_options=self.storage_options,
        )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.folders is not None:
            self.folders.close()
        self.folders = FolderCheckpoints(
            self.save_dir,
            self._run_name(args),
            catalog=self.catalog,
            storage_options=self.storage_options,
            num_to_keep=self.retention.num_to_keep,
            keep_every_steps=self.retention.keep_every_steps,
            framework="transformers",
            resume_step=self.resume_step,
            owner=OWNER,
        )
        self.folders.start(resumed_from=state.global_step or None)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.folders is None:
            self.on_train_begin(args, state, control)
        assert self.folders is not None
        step = state.global_step
        folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        save_id = self.folders.save_folder(folder, step)
        record_save(folder, save_id)  # the next job start checks this folder, not downloads it

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.folders is not None:
            # Every process has passed the collectives of its last save, so none still reads
            # the folder it resumed from.
            self.folders.close()
            self.folders = None
        remove_temporary_downloads()
