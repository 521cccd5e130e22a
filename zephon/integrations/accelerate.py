"""Hugging Face checkpoint folders as Zephon checkpoints: accelerate's ``save_state`` /
``load_state``, and the shared machinery the Trainer callback (``zephon.integrations.huggingface``)
uses.

Both frameworks write a checkpoint as a local folder of files (safetensors, pickled optimizer,
scheduler and RNG states). Zephon turns such a folder into checkpoint ``step`` of a run through
the one save path (``zephon.saving.Save``: catalog row ``pending -> committed | failed``, fenced
storage begin, every file with its size and CRC32C, the marker last), so a crash at any moment
leaves either the whole checkpoint or nothing; and it answers "where do I resume" with a local
folder holding the latest *complete* checkpoint, every byte checked against its CRC32C.

accelerate is imported only inside ``AcceleratorCheckpoints``; ``import zephon`` never imports it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from catalog import Catalog
from storage import (
    CheckpointNotFoundError,
    CheckpointStore,
    CorruptCheckpointError,
    Crc32c,
    FileEntry,
    InvalidNameError,
    Manifest,
    validate_run,
)
from zephon.attempts import Attempt, register_resuming
from zephon.errors import ConfigError, ZephonError
from zephon.gc import apply_retention
from zephon.latest import find_latest
from zephon.locations import CATALOG_URL_ENV, RunLocation
from zephon.outage import close_guard, ensure_run, open_catalog
from zephon.reconcile import quarantine
from zephon.saving import Save

__all__ = ["AcceleratorCheckpoints", "FolderCheckpoints", "fetch_latest"]

log = logging.getLogger("zephon")

#: manifest metadata that marks a checkpoint as a framework's folder
FOLDER_FORMAT = "hf-folder"
#: a file Zephon leaves in a downloaded folder: the save id it holds, verified
_VERIFIED = ".zephon-verified"
_CHUNK = 8 << 20
#: resume point meaning "continue the run's latest checkpoint"
_LATEST = object()


def _check_run(run_name: str) -> str:
    try:
        validate_run(run_name)
    except InvalidNameError as exc:
        raise ConfigError(f"run_name: {exc}") from None
    return run_name


def _open_catalog(catalog: Catalog | str | None) -> tuple[Catalog | None, bool]:
    """The catalog to use and whether this code opened it (and so closes it): a ``Catalog``,
    a SQLAlchemy URL, or None for ``$ZEPHON_CATALOG_URL`` (unset: no catalog)."""
    if isinstance(catalog, Catalog):
        return catalog, False
    url = catalog or os.environ.get(CATALOG_URL_ENV)
    if not url:
        return None, False
    return open_catalog(url), True


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
            if rel != _VERIFIED:
                files[rel] = os.path.getsize(path)
    return files


class FolderCheckpoints:
    """Saves local checkpoint folders as Zephon checkpoints of one run (every process).

    ``start`` (every process, once the process group exists) registers this job's attempt on
    the main process; ``save_folder`` (every process) uploads the folder of one step. Files a
    process sees are uploaded by the lowest rank that sees them, so ranks that write different
    files (per-rank RNG states, sharded optimizers) each upload their own and a shared file
    system uploads each file once.
    """

    def __init__(
        self,
        save_dir: str,
        run_name: str,
        *,
        catalog: Catalog | str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        num_to_keep: int | None = None,
        framework: str = "accelerate",
    ) -> None:
        if num_to_keep is not None and (
            isinstance(num_to_keep, bool) or not isinstance(num_to_keep, int) or num_to_keep < 1
        ):
            raise ConfigError(
                f"num_to_keep = {num_to_keep!r} is invalid: use an integer >= 1, or None to "
                "keep all"
            )
        self.run = _check_run(run_name)
        self.save_dir = save_dir
        self.storage_options = dict(storage_options or {})
        self.num_to_keep = num_to_keep
        self.framework = framework
        self._catalog_arg = catalog
        self.store: CheckpointStore | None = None
        self.catalog: Catalog | None = None
        self._owns_catalog = False
        self.attempt: Attempt | None = None
        self.coll = None
        self._save: Save | None = None  # main process: the save under way

    @property
    def location(self) -> RunLocation:
        assert self.store is not None, "call start() first"
        return RunLocation(self.run, self.store, self.run)

    def start(self, resumed_from: Any = _LATEST) -> None:
        """Every process: set up collectives; the main process opens storage and the catalog
        and registers this job's attempt, resuming from ``resumed_from`` (a step, None for a
        fresh start, or by default the run's latest complete checkpoint). From then on an
        older attempt of the run still running can no longer save, mark or delete anything."""
        from zephon.checkpointing.collectives import Collectives

        if self.coll is None:
            self.coll = Collectives()
        if self.store is None:
            self.store = CheckpointStore(self.save_dir, self.storage_options)
        self.coll.from_main(lambda: self._register(resumed_from), "register the attempt")

    def _register(self, resumed_from: Any) -> None:
        assert self.store is not None
        if self.catalog is None:
            self.catalog, self._owns_catalog = _open_catalog(self._catalog_arg)
            catalog = self.catalog
            if catalog is not None:
                ensure_run(
                    catalog,
                    self.location,
                    lambda: catalog.ensure_run(
                        self.run,
                        self.store.location.canonical_url,
                        kind="train",
                        status="active",
                        num_to_keep=self.num_to_keep,
                    ),
                )

        def choose(lineage):
            if resumed_from is not _LATEST:
                return resumed_from, None
            latest = find_latest(self.location, catalog=self.catalog, lineage=lineage)
            return (latest.step if latest is not None else None), None

        self.attempt, _ = register_resuming(self.location, self.catalog, choose)

    def save_folder(
        self, folder: str, step: int, metadata: Mapping[str, Any] | None = None
    ) -> None:
        """Every process: upload ``folder`` as checkpoint ``step`` and commit it (collective).

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
        if coll.is_main:
            writer = self._save.writer
        else:
            assert self.store is not None
            writer = self.store.attach(self.run, step, save_id=save_id)
        entries, problem = [], None
        try:
            entries = writer.write_many({name: os.path.join(folder, name) for name in mine})
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

    def _begin(self, step: int, metadata: Mapping[str, Any] | None) -> Any:
        assert self.attempt is not None
        info = {"format": FOLDER_FORMAT, "framework": self.framework, **(metadata or {})}
        self._save = Save.begin(self.attempt, step, catalog=self.catalog, metadata=info)
        return self._save.save_id

    def _commit(self, gathered: list[list[dict[str, Any]]] | None) -> None:
        save = self._save
        assert save is not None
        for rank_entries in (gathered or [])[1:]:
            save.writer.add_entries(FileEntry(**e) for e in rank_entries)
        save.commit()
        save.committed()
        self.apply_retention()

    def apply_retention(self) -> list[int]:
        """Main process: delete what ``num_to_keep`` no longer keeps, with the same fenced code
        the checkpoint manager and ``zephon gc`` use."""
        assert self.attempt is not None and self.store is not None
        return apply_retention(self.location, self.catalog, self.attempt.fence, self.num_to_keep)

    def close(self) -> None:
        """Release the process group, the store and a catalog this object opened."""
        if self.coll is not None:
            self.coll.destroy()
            self.coll = None
        if self.catalog is not None and self._owns_catalog:
            close_guard(self.catalog)
            self.catalog.close()
        self.catalog = None
        if self.store is not None:
            self.store.close()
            self.store = None
        self.attempt = None


# -- resuming ---------------------------------------------------------------------------------


def fetch_latest(
    save_dir: str,
    run_name: str,
    *,
    catalog: Catalog | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    local_dir: str | None = None,
) -> tuple[int, str] | None:
    """The latest complete checkpoint of the run as ``(step, local folder)``, or None.

    The folder holds exactly the files the manifest lists, every byte checked against its
    CRC32C: on local disk (and ``local_dir`` not given) the checkpoint's own payload directory,
    verified in place; otherwise a download into ``<local_dir>/checkpoint-<step>`` (default: a
    new temporary directory), reused when it already holds this very save. A checkpoint that
    fails verification is quarantined and the next complete one is taken."""
    _check_run(run_name)
    store = CheckpointStore(save_dir, storage_options)
    cat, owned = _open_catalog(catalog)
    location = RunLocation(run_name, store, run_name)
    try:
        while True:
            latest = find_latest(location, catalog=cat, on_corrupt=_warn_damaged, confirm=True)
            if latest is None:
                return None
            try:
                return latest.step, _materialize(store, run_name, latest.manifest, local_dir)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                with contextlib.suppress(Exception):
                    quarantine(
                        cat, location, latest.step, str(exc)[:2000], manifest=latest.manifest
                    )
                _warn_damaged(latest.step, str(exc))
    finally:
        if owned and cat is not None:
            cat.close()
        store.close()


def _warn_damaged(step: int, why: str) -> None:
    log.warning(
        "zephon: checkpoint step %s is damaged (%s); it is quarantined and an older one is taken",
        step,
        why.splitlines()[0][:300] if why else "",
    )


def _materialize(
    store: CheckpointStore, run: str, manifest: Manifest, local_dir: str | None
) -> str:
    meta = manifest.metadata or {}
    if meta.get("format") != FOLDER_FORMAT:
        raise ZephonError(
            f"checkpoint {store.checkpoint_url(run, manifest.step)} was not saved by the Hugging "
            "Face integration (no checkpoint folder in it); load it with zephon.CheckpointManager, "
            "or use another run_name"
        )
    reader = store.reader(run, manifest.step)
    if local_dir is None and store.location.backend.posix_paths:
        store.verify(run, manifest.step, deep=True).raise_for_problems()
        return reader.path
    base = local_dir if local_dir is not None else tempfile.mkdtemp(prefix=f"zephon-{run}-")
    target = os.path.join(base, f"checkpoint-{manifest.step}")
    if _already_fetched(target, manifest):
        return target
    partial = f"{target}.partial-{uuid.uuid4().hex[:8]}"
    os.makedirs(partial)
    try:
        with ThreadPoolExecutor(max_workers=store.max_workers) as pool:
            list(pool.map(lambda entry: _download(reader, entry, partial), manifest.files))
        with open(os.path.join(partial, _VERIFIED), "w") as out:
            out.write(manifest.save_id)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


def _already_fetched(target: str, manifest: Manifest) -> bool:
    try:
        with open(os.path.join(target, _VERIFIED)) as handle:
            if handle.read() != manifest.save_id:
                return False
    except OSError:
        return False
    return all(
        os.path.isfile(p := os.path.join(target, e.name)) and os.path.getsize(p) == e.size
        for e in manifest.files
    )


def _download(reader, entry: FileEntry, into: str) -> None:
    """Stream one file to ``into``, checking its size and CRC32C on the way."""
    path = os.path.join(into, *entry.name.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    running = Crc32c()
    with reader.open(entry.name) as source, open(path, "wb") as out:
        while chunk := source.read(_CHUNK):
            running.update(chunk)
            out.write(chunk)
    if running.size != entry.size or running.encoded() != entry.crc32c:
        raise CorruptCheckpointError(
            f"{entry.name} of checkpoint {reader.url} does not match its manifest ({running.size} "
            f"bytes, crc32c {running.encoded()}; the manifest says {entry.size}, "
            f"{entry.crc32c}); the checkpoint is damaged: resume from an earlier checkpoint",
            url=reader.url,
            run=reader.manifest.run,
            step=reader.manifest.step,
            path=entry.name,
            problems=[f"{entry.name}: size or crc32c mismatch"],
        )


# -- accelerate -------------------------------------------------------------------------------


class AcceleratorCheckpoints:
    """accelerate's ``save_state``/``load_state`` through Zephon, for one run.

    ``load_state()`` (every process) loads the latest complete checkpoint into the accelerator
    and returns its step (None: a fresh start); ``save_state(step)`` (every process) has
    accelerate write its folder into a local staging directory, then uploads and commits it as
    checkpoint ``step``. accelerate's own ``total_limit`` pruning is not used: ``num_to_keep``
    is applied after a commit, never before the new checkpoint exists.
    """

    def __init__(
        self,
        accelerator: Any,
        save_dir: str,
        run_name: str,
        *,
        catalog: Catalog | str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        num_to_keep: int | None = None,
        local_dir: str | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.folders = FolderCheckpoints(
            save_dir,
            run_name,
            catalog=catalog,
            storage_options=storage_options,
            num_to_keep=num_to_keep,
            framework="accelerate",
        )
        self.local_dir = local_dir or os.path.join(tempfile.gettempdir(), f"zephon-{run_name}")

    def load_state(self, **load_kwargs: Any) -> int | None:
        """Load the latest complete checkpoint (every process) and register this job's attempt
        as resuming from it; returns its step, or None when the run has none."""
        folders, accelerator = self.folders, self.accelerator
        # The main process opens the catalog first (it may create it): two processes creating
        # a new SQLite catalog at once can find it locked. The others follow once it is there.
        if not accelerator.is_main_process:
            accelerator.wait_for_everyone()
        found = fetch_latest(
            folders.save_dir,
            folders.run,
            catalog=folders._catalog_arg,
            storage_options=folders.storage_options,
            local_dir=os.path.join(self.local_dir, f"load-{accelerator.process_index}"),
        )
        if accelerator.is_main_process:
            accelerator.wait_for_everyone()
        step = found[0] if found is not None else None
        if found is not None:
            accelerator.load_state(found[1], **load_kwargs)
        folders.start(resumed_from=step)
        return step

    def save_state(self, step: int, **save_kwargs: Any) -> None:
        """Save the accelerator's state as checkpoint ``step`` (every process)."""
        staging = os.path.join(self.local_dir, f"save-{step}")
        accelerator = self.accelerator
        if accelerator.is_local_main_process and os.path.exists(staging):
            shutil.rmtree(staging)
        accelerator.wait_for_everyone()
        try:
            accelerator.save_state(output_dir=staging, **save_kwargs)
            self.folders.save_folder(staging, step)
        finally:
            accelerator.wait_for_everyone()
            if accelerator.is_local_main_process:
                shutil.rmtree(staging, ignore_errors=True)

    def close(self) -> None:
        self.folders.close()
