"""Hugging Face checkpoint folders as Zephon checkpoints: accelerate's ``save_state`` /
``load_state``, and the shared machinery the Trainer callback (``zephon.integrations.huggingface``)
uses.

Both frameworks write a checkpoint as a local folder of files (safetensors, pickled optimizer,
scheduler and RNG states). Zephon turns such a folder into checkpoint ``step`` of a run through
the one save path (``zephon.saving.Save``: catalog row ``pending -> committed | failed``, fenced
storage begin, every file with its size and CRC32C, the marker last), so a crash at any moment
leaves either the whole checkpoint or nothing; and it answers "where do I resume" with a local
folder holding the latest *complete* checkpoint, every byte checked against its CRC32C
(``zephon.integrations.download``: private, re-verified, one download per host).

accelerate is imported only inside ``AcceleratorCheckpoints``; ``import zephon`` never imports it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from zephon.errors import ConfigError, ZephonError
from zephon.integrations.download import FOLDER_FORMAT, VERIFIED, fetch_latest
from zephon.locations import RunLocation
from zephon.retention import Retention, RetentionOptions, check_resume_step
from zephon.saving import Save
from zephon.session import CatalogArg, RunSession, SessionParts, resolve_catalog
from zephon.storage import CheckpointStore, FileEntry, InvalidNameError, validate_run

__all__ = ["AcceleratorCheckpoints", "FolderCheckpoints", "fetch_latest"]

#: the files accelerate unpickles with ``weights_only=False`` (``load_custom_state``)
_CUSTOM_STATE = re.compile(r"^custom_checkpoint_\d+\.pkl$")


def _check_run(run_name: str) -> str:
    try:
        validate_run(run_name)
    except InvalidNameError as exc:
        raise ConfigError(f"run_name: {exc}") from None
    return run_name


def _folder_files(folder: str) -> dict[str, int]:
    """Every file under ``folder``, by its ``/``-separated relative name, with its size."""
    if not os.path.isdir(folder):
        raise ZephonError(
            f"checkpoint folder {folder} does not exist on this process; save into a folder "
            "every process can see, or call save on every process after it wrote its files"
        )
    files: dict[str, int] = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel != VERIFIED:
                files[rel] = os.path.getsize(path)
    return files


class FolderCheckpoints(RetentionOptions, SessionParts):
    """Saves local checkpoint folders as Zephon checkpoints of one run (every process).

    ``start`` (every process, once the process group exists) sets up and notes where the job
    resumed; ``save_folder`` (every process) uploads the folder of one step, the first one
    registering this job's attempt on the main process (loading alone writes nothing to the
    run). ``resume_step`` declares where the job resumes when it loaded nothing through Zephon
    (0: it starts over, abandoning the run's older checkpoints); without a resume point the
    attempt continues the run's latest checkpoint and a save below it is refused. Files a
    process sees are uploaded by the lowest rank that sees them, so ranks that write different
    files (per-rank RNG states, sharded optimizers) each upload their own and a shared file
    system uploads each file once.

    The run's lifecycle (the catalog: ``catalog``, else ``$ZEPHON_CATALOG_URL``; the run's
    row; the attempt; retention of ``num_to_keep`` and ``keep_every_steps``) is one
    ``zephon.session.RunSession``, made by ``start``. ``owner`` is the entry point that takes
    the options, named by their error messages.
    """

    def __init__(
        self,
        save_dir: str,
        run_name: str,
        *,
        catalog: CatalogArg = None,
        storage_options: Mapping[str, Any] | None = None,
        num_to_keep: int | None = None,
        keep_every_steps: int | None = None,
        framework: str = "accelerate",
        resume_step: int | None = None,
        owner: str = "FolderCheckpoints",
    ) -> None:
        self.retention = Retention.checked(owner, num_to_keep, keep_every_steps)
        self.resume_step = check_resume_step(owner, resume_step)
        #: the catalog to use (an open one, or its URL), or None: storage alone decides
        self.catalog_arg = resolve_catalog(catalog, owner)
        self.run = _check_run(run_name)
        self.save_dir = save_dir
        self.storage_options = dict(storage_options or {})
        self.framework = framework
        self.store: CheckpointStore | None = None
        #: the run's session (``start``): catalog, run row, attempt, retention
        self.session: RunSession | None = None
        self.coll = None
        self._save: Save | None = None  # main process: the save under way

    @property
    def location(self) -> RunLocation:
        assert self.store is not None, "call start() first"
        return RunLocation(self.run, self.store, self.run)

    def start(self, resumed_from: int | None = None) -> None:
        """Every process: set up collectives, storage and the run's session, and note
        ``resumed_from``, the step the job loaded (None: ``resume_step``, else the run's latest
        checkpoint). Nothing is written to the run: the first ``save_folder`` registers this
        job's attempt, and from then on an older attempt of the run still running can no
        longer save, mark or delete anything."""
        from zephon.collectives import Collectives

        if self.coll is None:
            self.coll = Collectives()
        if self.store is None:
            self.store = CheckpointStore(self.save_dir, self.storage_options)
        if self.session is None:
            self.session = RunSession(
                self.location,
                catalog=self.catalog_arg,
                retention=self.retention,
                resume_step=self.resume_step,
                is_main=self.coll.is_main,
            )
        self.session.note_loaded(resumed_from)

    def save_folder(self, folder: str, step: int, metadata: Mapping[str, Any] | None = None) -> str:
        """Every process: upload ``folder`` as checkpoint ``step`` and commit it (collective);
        returns the save's id.

        All processes wait until every one has written its files; the main process begins the
        save, every process uploads its share in parallel threads, the main process collects
        every file's size and CRC32C, commits the marker, records the commit and applies
        retention. A failure anywhere raises on every process and leaves no checkpoint."""
        if self.coll is None:
            self.start()
        coll = self.coll
        files, problem = {}, None
        try:
            files = _folder_files(folder)
        except Exception as exc:
            problem = exc
        coll.agree(problem, f"list checkpoint folder {folder}")  # the barrier before the save
        listings = coll.all_gather(files)
        owners: dict[str, int] = {}
        for rank, listing in enumerate(listings):
            for name in listing:
                owners.setdefault(name, rank)
        mine = sorted(name for name, rank in owners.items() if rank == coll.rank)
        save_id = coll.from_main(lambda: self._begin(step, metadata), f"begin checkpoint {step}")
        paths = {name: os.path.join(folder, name) for name in mine}
        if coll.world_size == 1:
            # One process: its files go out with the commit's fence re-check, then the marker
            # (docs/fencing.md, the commit rule), one round trip fewer. With several, each
            # uploads its share at once, and the commit must list them all once they are done.
            try:
                self._commit([], files=paths)
            except BaseException as exc:
                if self._save is not None:
                    self._save.failed(exc)
                raise
            return save_id
        if coll.is_main:
            writer = self._save.writer
        else:
            assert self.store is not None
            writer = self.store.run(self.run).attach(step, save_id=save_id)
        entries, problem = [], None
        try:
            entries = writer.write_many(paths)
        except Exception as exc:
            problem = exc
        try:
            coll.agree(problem, f"upload its files of checkpoint {step}")  # barrier before commit
            gathered = coll.gather([entry.to_dict() for entry in entries])
            coll.from_main(lambda: self._commit(gathered), f"commit checkpoint {step}")
        except BaseException as exc:
            if coll.is_main and self._save is not None:
                self._save.failed(exc)
            raise
        return save_id

    def _begin(self, step: int, metadata: Mapping[str, Any] | None) -> Any:
        """Main process: register the attempt at the first save, then begin this one."""
        session = self.session
        assert session is not None
        attempt = session.attempt_for_save()
        info = {"format": FOLDER_FORMAT, "framework": self.framework, **(metadata or {})}
        self._save = Save.begin(attempt, step, catalog=session.catalog, metadata=info)
        return self._save.save_id

    def _commit(
        self, gathered: list[list[dict[str, Any]]] | None, files: Mapping[str, str] | None = None
    ) -> None:
        """Main process: commit with the other processes' entries (``gathered``, the main's
        own first) and ``files``, its own files not yet written; record it, apply retention."""
        save = self._save
        assert save is not None
        for rank_entries in (gathered or [])[1:]:
            save.writer.add_entries(FileEntry(**e) for e in rank_entries)
        save.commit(files=files)
        save.committed()
        self.apply_retention()

    def apply_retention(self) -> list[int]:
        """Main process: delete what the retention (``num_to_keep``, ``keep_every_steps``, the
        catalog's pins) no longer keeps, with the same fenced code the checkpoint manager and
        ``zephon gc`` use (``RunSession.retain``)."""
        assert self.session is not None and self.session.attempt is not None
        return self.session.retain()

    def close(self) -> None:
        """Release the process group, the run's session (a catalog it opened) and the
        store."""
        if self.coll is not None:
            self.coll.destroy()
            self.coll = None
        if self.session is not None:
            self.session.close()
            self.session = None
        if self.store is not None:
            self.store.close()
            self.store = None


# -- accelerate -------------------------------------------------------------------------------


class AcceleratorCheckpoints:
    """accelerate's ``save_state``/``load_state`` through Zephon, for one run.

    ``load_state()`` (every process) loads the latest complete checkpoint into the accelerator
    and returns its step (None: a fresh start); ``save_state(step)`` (every process) has
    accelerate write its folder into a local staging directory, then uploads and commits it as
    checkpoint ``step``. accelerate's own ``total_limit`` pruning is not used: ``num_to_keep``
    (and ``keep_every_steps``: also keep each checkpoint whose step is a multiple of it) is
    applied after a commit, never before the new checkpoint exists. ``catalog``: a
    ``catalog.Catalog`` or its URL, else ``$ZEPHON_CATALOG_URL`` (unset: storage alone).

    ``local_dir`` holds the staging folders and the downloads (reused across jobs, re-verified
    before each use); without it both go to private temporary directories (mode 0700) that are
    removed when done. accelerate unpickles the states of objects registered with
    ``register_for_checkpointing`` (``custom_checkpoint_<i>.pkl``) with ``weights_only=False``,
    so a checkpoint holding them is loaded only with ``trust_custom_states=True``: whoever can
    write the checkpoint's storage can run code in the job through them.
    ``resume_step``: where the job resumes when it does not ``load_state``
    (``FolderCheckpoints``).
    """

    def __init__(
        self,
        accelerator: Any,
        save_dir: str,
        run_name: str,
        *,
        catalog: CatalogArg = None,
        storage_options: Mapping[str, Any] | None = None,
        num_to_keep: int | None = None,
        keep_every_steps: int | None = None,
        local_dir: str | None = None,
        trust_custom_states: bool = False,
        resume_step: int | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.folders = FolderCheckpoints(
            save_dir,
            run_name,
            catalog=catalog,
            storage_options=storage_options,
            num_to_keep=num_to_keep,
            keep_every_steps=keep_every_steps,
            framework="accelerate",
            resume_step=resume_step,
            owner="AcceleratorCheckpoints",
        )
        self.local_dir = local_dir
        self.trust_custom_states = bool(trust_custom_states)
        #: this process's private staging directory (without ``local_dir``), made on first save
        self._staging_root: str | None = None

    def load_state(self, **load_kwargs: Any) -> int | None:
        """Load the latest complete checkpoint (every process); returns its step, or None when
        the run has none. One process per host downloads it; a temporary download is removed
        once every process has loaded it. The first ``save_state`` registers this job's attempt,
        resuming from it (a load alone writes nothing to the run)."""
        folders, accelerator = self.folders, self.accelerator
        found = fetch_latest(
            folders.save_dir,
            folders.run,
            catalog=folders.catalog_arg,
            storage_options=folders.storage_options,
            local_dir=self.local_dir,
        )
        try:
            if found is not None:
                self._check_custom_states(found.folder, found.step)
                accelerator.load_state(found.folder, **load_kwargs)
        finally:
            accelerator.wait_for_everyone()  # every process has read the shared folder
            if found is not None:
                found.remove()
        step = found.step if found is not None else None
        folders.start(resumed_from=step)
        return step

    def _check_custom_states(self, folder: str, step: int) -> None:
        custom = sorted(name for name in os.listdir(folder) if _CUSTOM_STATE.match(name))
        if custom and not self.trust_custom_states:
            raise ConfigError(
                f"checkpoint {step} of run {self.folders.run!r} holds accelerate custom states "
                f"({', '.join(custom[:3])}), which accelerate unpickles with weights_only=False "
                "(a tampered file runs code): pass AcceleratorCheckpoints(..., "
                "trust_custom_states=True) only if nobody else can write its storage"
            )

    def _staging(self, step: int) -> tuple[str, bool]:
        """Where accelerate writes checkpoint ``step`` and whether this process clears it."""
        if self.local_dir is not None:
            return os.path.join(self.local_dir, f"save-{step}"), (
                self.accelerator.is_local_main_process
            )
        if self._staging_root is None:
            self._staging_root = tempfile.mkdtemp(prefix=f"zephon-{self.folders.run}-")
        return os.path.join(self._staging_root, f"save-{step}"), True

    def save_state(self, step: int, **save_kwargs: Any) -> None:
        """Save the accelerator's state as checkpoint ``step`` (every process)."""
        staging, clears = self._staging(step)
        accelerator = self.accelerator
        if clears and os.path.exists(staging):
            shutil.rmtree(staging)
        accelerator.wait_for_everyone()
        try:
            accelerator.save_state(output_dir=staging, **save_kwargs)
            self.folders.save_folder(staging, step)
        finally:
            accelerator.wait_for_everyone()
            if clears:
                shutil.rmtree(staging, ignore_errors=True)

    def close(self) -> None:
        """Release the process group and the store; remove the private staging directory."""
        self.folders.close()
        if self._staging_root is not None:
            shutil.rmtree(self._staging_root, ignore_errors=True)
            self._staging_root = None
