"""Lightning integration: ``ZephonCheckpointIO`` stores Lightning's checkpoint dict through
Zephon's one save path (catalog row, fenced storage save, marker last), without pickle, and
``ZephonRNG`` saves and restores the random number generators Lightning leaves out.

Lightning's checkpoint paths are names here, not files: a save of ``.../epoch=1-step=20.ckpt``
becomes checkpoint ``global_step`` of the run (``<save_dir>/<run>/save-<step>/``), holding
``lightning.json`` (everything but tensors, ``zephon.state_tree``'s JSON) and
``tensors.safetensors``; the name goes into the manifest's metadata. Resume with
``trainer.fit(model, ckpt_path=LATEST)``: ``load_checkpoint`` answers ``zephon://latest`` with
the run's latest complete checkpoint (``zephon.latest.find_latest``); this job's attempt is
registered at its first save, resuming from the step loaded (a load alone writes nothing, so
``validate``/``predict`` never touch the run). A job that loaded nothing and did not declare
``resume_step`` cannot save below the run's latest checkpoint: Lightning's ``ckpt_path="last"``
finds no ``last.ckpt`` file here (checkpoint names are not files) and would start over at step
0; the first save then stops it with one line naming ``LATEST``. See docs/lightning.md.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO

from zephon.attempts import Attempt
from zephon.catalog import Catalog
from zephon.checkpointing.files import capture_rng, decode_json, encode_json, restore_rng
from zephon.errors import ConfigError, SaveBelowLatestError, ZephonError
from zephon.gc import delete_requested
from zephon.integrations.download import open_catalog
from zephon.latest import find_latest
from zephon.locations import RunLocation
from zephon.outage import close_guard
from zephon.retention import Retention, RetentionOptions, check_resume_step
from zephon.saving import Save
from zephon.session import RunSession, SessionParts, resolve_catalog
from zephon.state_tree import join_state, split_state
from zephon.storage import (
    CheckpointNotFoundError,
    CheckpointStore,
    CorruptCheckpointError,
    InvalidNameError,
    mask_url,
    parse_number,
    validate_run,
)

__all__ = ["LATEST", "ZephonCheckpointIO", "ZephonRNG", "latest_ckpt_path"]

log = logging.getLogger("zephon")

#: who takes the plugin's options, as its error messages name it
OWNER = "ZephonCheckpointIO"
#: ``ckpt_path`` value that resumes from the run's latest complete checkpoint (or starts fresh)
LATEST = "zephon://latest"
_SCHEME = "zephon://"
JSON_FILE = "lightning.json"
TENSOR_FILE = "tensors.safetensors"
FORMAT_VERSION = 1


class ZephonCheckpointIO(CheckpointIO, RetentionOptions, SessionParts):
    """A Lightning ``CheckpointIO`` that saves every checkpoint as Zephon checkpoint
    ``global_step`` of ``run_name`` under ``save_dir`` (a path or fsspec URL).

    ``catalog``: a SQLAlchemy URL or an open ``catalog.Catalog`` (None: ``$ZEPHON_CATALOG_URL``,
    unset: storage only).
    ``num_to_keep``: after each save the oldest checkpoints beyond this many are deleted by
    Zephon's retention (None keeps all), except each checkpoint whose step is a multiple of
    ``keep_every_steps`` (milestones); Lightning's ``save_top_k`` removals also reach it,
    also through ``AsyncCheckpointIO``: a removal that arrives while its save is still queued
    or running is applied once that save committed.
    ``resume_step``: the step this job resumes from when it does not load through this plugin
    (0: it starts over); the run's older checkpoints above it are abandoned. Without it and
    without a load, a save below the run's latest checkpoint is refused.

    The run's lifecycle (catalog, run row, attempt, retention) is one
    ``zephon.session.RunSession`` (``session``); every option is checked here, at
    construction (``zephon.retention``).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        run_name: str,
        *,
        catalog: str | Catalog | None = None,
        storage_options: Mapping[str, Any] | None = None,
        num_to_keep: int | None = None,
        keep_every_steps: int | None = None,
        resume_step: int | None = None,
    ) -> None:
        super().__init__()
        try:
            validate_run(run_name)
        except InvalidNameError as exc:
            raise ConfigError(f"{OWNER} run_name: {exc}") from None
        retention = Retention.checked(OWNER, num_to_keep, keep_every_steps)
        resume_step = check_resume_step(OWNER, resume_step)
        resolved = resolve_catalog(catalog, OWNER)
        self.run = run_name
        self.store = CheckpointStore(os.fspath(save_dir), dict(storage_options or {}))
        self.location = RunLocation(run_name, self.store, run_name)
        #: the run's session: the catalog (opened now, with the run's row), the attempt
        #: (registered at the first save), retention
        self.session = RunSession(
            self.location, catalog=resolved, retention=retention, resume_step=resume_step
        )
        _ = self.session.catalog  # open it and record the run's row now, as a job starts
        #: Lightning names of each step this process knows of (a step saved twice, e.g.
        #: top-k and ``last.ckpt``, is one checkpoint with two names)
        self._names: dict[int, set[str]] = {}
        #: whether the last load was ``LATEST`` on a run with no checkpoint (``ZephonRNG``
        #: then tells Lightning no checkpoint was restored)
        self.started_fresh = False
        #: name -> step of the save running now (``AsyncCheckpointIO`` saves in a thread)
        self._saving: dict[str, int] = {}
        #: names Lightning removed before their save committed: deleted once it has
        self._removed_early: set[str] = set()
        #: ``_names``, ``_saving``, ``_removed_early`` and the attempt, between the saving
        #: thread and the trainer's (never held while bytes are written)
        self._lock = threading.RLock()

    @property
    def retention(self) -> Retention:
        return self.session.retention

    @property
    def resume_step(self) -> int | None:
        return self.session.resume_step

    # -- save ------------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save Lightning's dict as checkpoint ``checkpoint["global_step"]``: tensors as
        safetensors, the rest as JSON, through ``zephon.saving.Save``; then retention."""
        if storage_options is not None:
            raise ZephonError(
                "ZephonCheckpointIO takes no per-save storage_options; pass storage_options "
                "to ZephonCheckpointIO(...) instead"
            )
        name = str(path)
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ZephonError(
                f"checkpoint {name}: global_step {step!r} is not a non-negative integer; "
                "ZephonCheckpointIO saves Lightning checkpoint dicts only"
            )
        tensors, skeleton = split_state(checkpoint)
        document = encode_json({"format_version": FORMAT_VERSION, "state": skeleton})
        blob = _safetensors_bytes(tensors)
        with self._lock:
            self._drop_name(name)  # a name saved again (last.ckpt) no longer names the older one
            if step in self._names:  # the same step under a second name: one checkpoint
                self._names[step].add(name)
                self._apply_early_removal(name)
                return
            attempt = self._current_attempt()
            self._saving[name] = step
        try:
            with Save.begin(
                attempt, step, catalog=self.catalog, metadata={"lightning_path": name}
            ) as writer:
                # both files go out with the fence re-check, then the marker: one round trip
                # fewer than writing them first (docs/fencing.md, the commit rule)
                writer.commit(files={JSON_FILE: document, TENSOR_FILE: blob})
        except BaseException as exc:
            with self._lock:
                self._saving.pop(name, None)
            if not isinstance(exc, SaveBelowLatestError):
                raise
            raise SaveBelowLatestError(
                f"run {self.run}: refusing to save step {step} below its latest checkpoint "
                f"{exc.latest}: this fit did not resume from it (Lightning's ckpt_path='last' "
                f"finds no file with ZephonCheckpointIO); resume with ckpt_path=LATEST "
                f"({LATEST!r}), or declare ZephonCheckpointIO(resume_step=N)",
                run=self.run,
                step=step,
                latest=exc.latest,
            ) from None
        with self._lock:  # one step: a removal sees the name either saving or saved
            self._saving.pop(name, None)
            self._names[step] = {name}
            self._apply_early_removal(name)
        self.session.retain()

    def _apply_early_removal(self, name: str) -> None:
        """``name`` was removed by Lightning before its save committed (``AsyncCheckpointIO``
        runs saves in a thread, removals in the trainer's): remove it now."""
        if name in self._removed_early:
            self._removed_early.discard(name)
            self.remove_checkpoint(name)

    def _current_attempt(self) -> Attempt:
        """This job's attempt, registered at the first save (or removal): resuming from the
        step loaded or ``resume_step``, else continuing the latest complete checkpoint
        (never abandoning history implicitly; a save below it is refused)."""
        with self._lock:
            return self.session.attempt_for_save()

    # -- remove ----------------------------------------------------------------------------

    def remove_checkpoint(self, path: Any) -> None:
        """Lightning no longer wants ``path`` (``save_top_k``): the checkpoint it names is
        deleted, fenced, marker first, once no other name (``last.ckpt``) refers to it."""
        name = str(path)
        with self._lock:
            if name in self._saving:  # its save is running in another thread: after it commits
                self._removed_early.add(name)
                return
            steps = [s for s, names in self._names.items() if name in names]
            if not steps:
                steps = [s for s in self._steps_named(name) if s not in self._names]
                if not steps:  # nothing saved under it yet: a save still queued (async)
                    self._removed_early.add(name)
                    return
                for s in steps:
                    self._names[s] = {name}
            for step in steps:
                self._names[step].discard(name)
                if not self._names[step]:
                    self._delete(step)

    def _drop_name(self, name: str) -> None:
        for step in [s for s, names in self._names.items() if name in names]:
            self._names[step].discard(name)
            if not self._names[step]:
                self._delete(step)

    def _steps_named(self, name: str) -> list[int]:
        """Steps saved under ``name`` by an earlier process, from the manifests' metadata."""
        if self.catalog is not None:
            rows = self.catalog.list_checkpoints(self.run, states="committed")
            return [r.step for r in rows if (r.metadata or {}).get("lightning_path") == name]
        manifests = self.store.run(self.run).complete()
        return [m.step for m in manifests if (m.metadata or {}).get("lightning_path") == name]

    def _delete(self, step: int) -> None:
        """Delete one checkpoint, fenced by this attempt: a stale attempt deletes nothing."""
        del self._names[step]
        delete_requested(self.location, self.catalog, self._current_attempt().fence, [step])

    # -- load ------------------------------------------------------------------------------

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's dict of ``LATEST`` (the run's latest complete checkpoint; for none an
        empty, falsy dict: a fresh start, Lightning restores nothing), of
        ``zephon://<run>/<step>`` or of a name this run saved under (one it never saved under:
        ``zephon.CheckpointNotFoundError``); every byte is checked against its CRC32C."""
        name = str(path)
        self.started_fresh = False
        if name == LATEST:
            latest = find_latest(self.location, catalog=self.catalog, confirm=True)
            if latest is None:
                log.info("zephon: run %s has no checkpoint yet: starting fresh", self.run)
                self.started_fresh = True
                return _NoCheckpoint()
            step = latest.step
        elif name.startswith(_SCHEME):
            step = _parse_step(name, self.run)
        else:
            steps = self._steps_named(name)
            if not steps:
                raise CheckpointNotFoundError(
                    f"run {self.run} has no checkpoint saved as {name!r}; resume with "
                    f"ckpt_path={LATEST!r}",
                    run=self.run,
                )
            step = max(steps)
        reader = self.store.run(self.run).reader(step)
        where = f"{reader.url}/{JSON_FILE}"
        doc = decode_json(reader.read_bytes(JSON_FILE), where)
        if (
            not isinstance(doc, dict)
            or "state" not in doc
            or type(doc.get("format_version", 0)) is not int
        ):
            raise CorruptCheckpointError(
                f"{where} is not a Zephon Lightning checkpoint document (an object with "
                "'state' and a whole format_version); the checkpoint is damaged: resume from "
                "an earlier one",
                url=where,
                problems=[f"{where}: not a Zephon Lightning checkpoint document"],
            )
        if doc.get("format_version", 0) > FORMAT_VERSION:
            raise ZephonError(f"{reader.url} was written by a newer Zephon; upgrade to load it")
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(reader.read_bytes(TENSOR_FILE))
        with self._lock:
            self._names.setdefault(step, set())
            self.session.note_loaded(step)
        return join_state(doc["state"], tensors)

    def close(self) -> None:
        """Release the catalog this plugin opened from a URL (Lightning's ``teardown`` after
        each ``fit`` keeps it, so the plugin can serve another ``fit``); the attempt stays."""
        self.session.close_catalog()


class _NoCheckpoint(dict):
    """What ``LATEST`` loads when the run has no checkpoint: Lightning restores nothing from
    a falsy dict, and its version migration finds the version key it reads first."""

    def __init__(self) -> None:
        import lightning

        super().__init__({"pytorch-lightning_version": lightning.__version__})

    def __bool__(self) -> bool:
        return False


def _parse_step(name: str, run: str) -> int:
    rest = name[len(_SCHEME) :]
    owner, _, step = rest.partition("/")
    number = parse_number(step)
    if owner != run or number is None:
        raise ZephonError(
            f"ckpt_path {name[:200]!r} is not a checkpoint of run {run}; use {LATEST!r} or "
            f"zephon://{run}/<step> (<step> in ASCII digits)"
        )
    return number


def _safetensors_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of the tensors; tensors sharing storage are copied (safetensors
    refuses shared storage)."""
    from safetensors.torch import save

    seen: set[tuple[int, int]] = set()
    ready: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        ident = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if ident in seen and tensor.numel():
            tensor = tensor.clone()
        seen.add(ident)
        ready[key] = tensor
    return save(ready)


def latest_ckpt_path(
    save_dir: str | os.PathLike[str],
    run_name: str,
    *,
    catalog: str | Catalog | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> str | None:
    """``zephon://<run>/<step>`` of the run's latest complete checkpoint, or None: for code
    that wants to know before ``fit`` (``ckpt_path=LATEST`` does the same inside ``fit``).
    ``catalog``: as ``ZephonCheckpointIO``'s (None: ``$ZEPHON_CATALOG_URL``)."""
    store = CheckpointStore(os.fspath(save_dir), dict(storage_options or {}))
    opened, owned = open_catalog(catalog, "latest_ckpt_path")
    try:
        latest = find_latest(RunLocation(run_name, store, run_name), catalog=opened, confirm=True)
    except Exception as exc:
        raise ZephonError(
            f"cannot find the latest checkpoint of run {run_name} in "
            f"{mask_url(os.fspath(save_dir))}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        if owned and opened is not None:
            close_guard(opened)
            opened.close()
    return None if latest is None else f"{_SCHEME}{run_name}/{latest.step}"


class ZephonRNG(Callback):
    """Saves the torch, numpy and Python RNG states with each checkpoint and restores them
    when training starts again, so dropout and DataLoader shuffling continue as if never
    interrupted (Lightning itself saves no RNG state).

    On a fresh start (``ckpt_path=LATEST``, the run has no checkpoint yet) it also clears the
    Trainer's ``ckpt_path`` at ``on_fit_start``, between Lightning's load and its
    ``resume_end``, which otherwise logs "Restored all states from the checkpoint at
    zephon://latest" for a checkpoint that does not exist. Lightning resolves ``ckpt_path``
    before any hook runs and refuses a falsy one, so no earlier moment can answer None."""

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return "ZephonRNG"

    def state_dict(self) -> dict[str, Any]:
        return {"rng": capture_rng()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict.get("rng")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # After the restore and right before the fit loop creates the DataLoader iterator
        # (which draws the shuffle seed), as a checkpoint saved at an epoch's end left it.
        if self._pending is not None:
            restore_rng(self._pending)
            self._pending = None
        plugin = _zephon_plugin(trainer)
        if plugin is not None and plugin.started_fresh and str(trainer.ckpt_path) == LATEST:
            trainer.ckpt_path = None  # Lightning's public setter: nothing was restored


def _zephon_plugin(trainer: Any) -> ZephonCheckpointIO | None:
    """The trainer's ``ZephonCheckpointIO``, also inside a wrapper (``AsyncCheckpointIO``)."""
    plugin = getattr(trainer.strategy, "checkpoint_io", None)
    while plugin is not None and not isinstance(plugin, ZephonCheckpointIO):
        plugin = getattr(plugin, "checkpoint_io", None)
    return plugin
