"""The latest complete checkpoint folder of a run on local disk, for frameworks that load a
checkpoint by path (the Hugging Face ``Trainer``, accelerate's ``load_state``).

Those frameworks unpickle some of the files they find there, so the folder is treated as code:

- a download goes into a directory only this user can enter, made fresh for it
  (``tempfile.mkdtemp``, mode 0700), never into a predictable path another user could have
  planted first; a temporary download is removed by whoever asked for it (``Fetched.remove``);
- a folder in the caller's ``local_dir`` that already holds the save is reused only after every
  file is checked again against the manifest (size and CRC32C, ``storage.verify_checkpoint``),
  and files the manifest does not list are removed from it first; a checkpoint verified in place
  on local storage is refused if its folder holds files its manifest does not list;
- under ``torch.distributed`` the call is collective and the processes of one host share one
  download: the host's lowest rank downloads, the others wait for it and use its folder (a
  process that cannot enter that folder downloads its own).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from zephon import outage
from zephon.catalog import Catalog
from zephon.errors import ConfigError, ZephonError
from zephon.latest import find_latest
from zephon.locations import RunLocation
from zephon.reconcile import quarantine
from zephon.session import CatalogArg, resolve_catalog
from zephon.storage import (
    MARKER_NAME,
    CheckpointNotFoundError,
    CheckpointStore,
    CorruptCheckpointError,
    Crc32c,
    FileEntry,
    InvalidNameError,
    Manifest,
    open_location,
    validate_run,
    verify_checkpoint,
)

__all__ = [
    "FOLDER_FORMAT",
    "VERIFIED",
    "Fetched",
    "fetch_latest",
    "open_catalog",
    "record_save",
]

log = logging.getLogger("zephon")

#: manifest metadata that marks a checkpoint as a framework's folder
FOLDER_FORMAT = "hf-folder"
#: a file Zephon leaves in a downloaded folder: the save id it holds, verified
VERIFIED = ".zephon-verified"
_CHUNK = 8 << 20
_VERIFY_THREADS = 4
#: how long the other ranks of a host wait for its leader's download (a large checkpoint on a
#: slow link takes a while; a dead leader still fails them, through the process group)
_DOWNLOAD_TIMEOUT = dt.timedelta(hours=2)


class Fetched(NamedTuple):
    """A checkpoint on local disk: its ``step`` and the ``folder`` to hand the framework."""

    step: int
    folder: str
    #: the private temporary directory holding ``folder`` that this process made, if any
    temporary: str | None = None

    def remove(self) -> None:
        """Remove the temporary download, once every process has loaded it (a folder in the
        caller's ``local_dir`` or verified in place is kept)."""
        if self.temporary is not None:
            shutil.rmtree(self.temporary, ignore_errors=True)


def open_catalog(catalog: CatalogArg, owner: str = "") -> tuple[Catalog | None, bool]:
    """The catalog a reader uses and whether this code opened it (and so closes it): a
    ``Catalog``, a SQLAlchemy URL, or None for ``$ZEPHON_CATALOG_URL`` (unset: no catalog),
    resolved by ``zephon.session.resolve_catalog`` (``owner`` names the argument in its
    error). A reader writes nothing to the run, so no run row is made here (a saving job's
    ``RunSession`` makes it)."""
    resolved = resolve_catalog(catalog, owner)
    if resolved is None or isinstance(resolved, Catalog):
        return resolved, False
    return outage.open_catalog(resolved), True


def fetch_latest(
    save_dir: str,
    run_name: str,
    *,
    catalog: CatalogArg = None,
    storage_options: Mapping[str, Any] | None = None,
    local_dir: str | None = None,
) -> Fetched | None:
    """The latest complete checkpoint of the run on local disk, or None when it has none.

    The folder holds exactly the files the manifest lists, every byte checked against its
    CRC32C: on local disk (and ``local_dir`` not given) the checkpoint's own payload directory,
    verified in place; otherwise a download into ``<local_dir>/checkpoint-<step>`` (reused
    when it holds this very save and passes the check again), or without ``local_dir`` into a
    fresh private temporary directory (``Fetched.remove`` removes it). A checkpoint that fails
    verification is quarantined and the next complete one is taken. Under
    ``torch.distributed`` every process must call it: one download per host."""
    try:
        validate_run(run_name)
    except InvalidNameError as exc:
        raise ConfigError(f"run_name: {exc}") from None
    catalog = resolve_catalog(catalog, "fetch_latest")  # on every process, before any fetches

    def fetch(base: str | None) -> Fetched | None:
        return _fetch(save_dir, run_name, catalog, storage_options, local_dir, base)

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return fetch(None)
    return _fetch_once_per_host(fetch, run_name, local_dir)


def _fetch(
    save_dir: str,
    run: str,
    catalog: CatalogArg,
    storage_options: Mapping[str, Any] | None,
    local_dir: str | None,
    base: str | None,
) -> Fetched | None:
    store = CheckpointStore(save_dir, storage_options)
    cat, owned = open_catalog(catalog)
    location = RunLocation(run, store, run)
    try:
        while True:
            latest = find_latest(location, catalog=cat, on_corrupt=_warn_damaged, confirm=True)
            if latest is None:
                return None
            try:
                return _materialize(store, run, latest.manifest, local_dir, base)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                with contextlib.suppress(Exception):
                    quarantine(
                        cat, location, latest.step, str(exc)[:2000], manifest=latest.manifest
                    )
                _warn_damaged(latest.step, str(exc))
    finally:
        if owned and cat is not None:
            outage.close_guard(cat)
            cat.close()
        store.close()


def _fetch_once_per_host(
    fetch: Callable[[str | None], Fetched | None], run: str, local_dir: str | None
) -> Fetched | None:
    """Collective: the lowest rank of each host fetches (into ``local_dir``, or a private
    temporary directory it made), the other ranks of the host use its folder."""
    from zephon.collectives import Collectives

    coll = Collectives(timeout=_DOWNLOAD_TIMEOUT)
    try:
        hosts = coll.all_gather(socket.gethostname())
        leader = hosts.index(hosts[coll.rank])
        made = _private_dir(run) if coll.rank == leader and local_dir is None else None
        offered = coll.all_gather(made)[leader]
        own = coll.rank == leader or (local_dir is None and not _is_private(offered))
        if own and coll.rank != leader:
            made = _private_dir(run)  # another disk, or another user: its own download
        found, problem = None, None
        if own:
            try:
                found = fetch(made)
            except Exception as exc:
                problem = exc
        if made is not None and (found is None or found.temporary != made):
            shutil.rmtree(made, ignore_errors=True)  # not used: nothing was downloaded
        coll.agree(problem, f"fetch the latest checkpoint of run {run!r}")
        results = coll.all_gather(tuple(found) if own and found is not None else None)
        if own:
            return found
        theirs = results[leader]
        # The host's leader removes its temporary download; this process only reads it.
        return Fetched(theirs[0], theirs[1]) if theirs is not None else None
    finally:
        coll.destroy()


def _private_dir(run: str) -> str:
    return tempfile.mkdtemp(prefix=f"zephon-{run}-")  # mode 0700, a name nobody could plant


def _is_private(path: str | None) -> bool:
    """Whether ``path`` is a directory (not a link) that only this user can enter."""
    if path is None:
        return False
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and not info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    )


def _warn_damaged(step: int, why: str) -> None:
    log.warning(
        "zephon: checkpoint step %s is damaged (%s); it is quarantined and an older one is taken",
        step,
        why.splitlines()[0][:300] if why else "",
    )


def _materialize(
    store: CheckpointStore, run: str, manifest: Manifest, local_dir: str | None, base: str | None
) -> Fetched:
    meta = manifest.metadata or {}
    if meta.get("format") != FOLDER_FORMAT:
        raise ZephonError(
            f"checkpoint {store.run(run).checkpoint_url(manifest.step)} was not saved by the "
            "Hugging Face integration (no checkpoint folder in it); load it with "
            "zephon.CheckpointManager, or use another run_name"
        )
    reader = store.run(run).reader(manifest.step)
    if local_dir is None and store.location.backend.posix_paths:
        store.run(run).verify(manifest.step, deep=True).raise_for_problems()
        extra = [name for name in _unlisted(reader.path, manifest) if name != MARKER_NAME]
        if extra:
            raise CorruptCheckpointError(
                f"checkpoint {reader.url} holds files its manifest does not list "
                f"({', '.join(extra[:5])}): someone else wrote into it, so it is not loaded: "
                "resume from an earlier checkpoint",
                url=reader.url,
                run=run,
                step=manifest.step,
                problems=[f"{name}: not in the manifest" for name in extra],
            )
        return Fetched(manifest.step, reader.path)
    temporary = None
    if local_dir is not None:
        os.makedirs(local_dir, exist_ok=True)
        base = local_dir
    elif base is None:
        base = temporary = _private_dir(run)
    else:
        temporary = base
    target = os.path.join(base, f"checkpoint-{manifest.step}")
    if local_dir is not None and _reusable(target, manifest):
        return Fetched(manifest.step, target)
    # A private (0700) partial folder, moved to its final name once every file is verified.
    partial = tempfile.mkdtemp(prefix=f"checkpoint-{manifest.step}.partial-", dir=base)
    try:
        with ThreadPoolExecutor(max_workers=store.max_workers) as pool:
            list(pool.map(lambda entry: _download(reader, entry, partial), manifest.files))
        with open(os.path.join(partial, VERIFIED), "w") as out:
            out.write(manifest.save_id)
        if os.path.lexists(target):
            _remove(target)
        os.replace(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    return Fetched(manifest.step, target, temporary)


def record_save(folder: str, save_id: str) -> None:
    """Note in ``folder``, whose files were just committed as save ``save_id``, that it holds
    that save: ``fetch_latest`` into its parent then checks it again instead of downloading
    it (``_reusable``: every file's size and CRC32C against the manifest, unlisted ones removed).
    Written whole (temp file + rename): every process of a shared folder writes the same."""
    temp = os.path.join(folder, f"{VERIFIED}.{os.getpid()}.tmp")
    with open(temp, "w") as out:
        out.write(save_id)
    os.replace(temp, os.path.join(folder, VERIFIED))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _unlisted(folder: str, manifest: Manifest) -> list[str]:
    """Every entry under ``folder`` that is not a file the manifest lists (nor the marker
    ``VERIFIED``): unlisted files, links, and directories holding no listed file."""
    listed = {entry.name for entry in manifest.files} | {VERIFIED}
    parents = {name.rsplit("/", i)[0] for name in listed for i in range(1, name.count("/") + 1)}
    extra = []
    for root, dirs, names in os.walk(folder):
        rel = os.path.relpath(root, folder).replace(os.sep, "/")
        prefix = "" if rel == "." else f"{rel}/"
        for name in sorted(dirs):
            path = os.path.join(root, name)
            if os.path.islink(path) or f"{prefix}{name}" not in parents:
                extra.append(f"{prefix}{name}")
        dirs[:] = [d for d in dirs if f"{prefix}{d}" not in extra]
        for name in sorted(names):
            path = os.path.join(root, name)
            if os.path.islink(path) or f"{prefix}{name}" not in listed:
                extra.append(f"{prefix}{name}")
    return extra


def _reusable(target: str, manifest: Manifest) -> bool:
    """Whether ``target`` (a folder of ``local_dir``) holds this very save: its marker names
    the save, files the manifest does not list are removed from it, and every listed file is a
    regular file whose size and CRC32C match the manifest again (a flipped byte since the last
    run, or a file planted under a listed name, is caught here, not by the framework)."""
    try:
        if os.path.islink(target):
            return False
        with open(os.path.join(target, VERIFIED)) as handle:
            if handle.read() != manifest.save_id:
                return False
        for name in _unlisted(target, manifest):
            _remove(os.path.join(target, *name.split("/")))
    except OSError:
        return False
    location = open_location(target)
    with ThreadPoolExecutor(max_workers=_VERIFY_THREADS) as pool:
        report = verify_checkpoint(
            location, target, manifest, url=target, deep=True, executor_factory=lambda: pool
        )
    if not report.ok:
        log.warning(
            "zephon: %s no longer matches checkpoint %s (%s); downloading it again",
            target,
            manifest.step,
            "; ".join(str(p) for p in report.problems[:3]),
        )
    return report.ok


def _download(reader: Any, entry: FileEntry, into: str) -> None:
    """Stream one file to ``into``, checking its size and CRC32C on the way."""
    path = os.path.join(into, *entry.name.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    running = Crc32c()
    with reader.open(entry.name) as source, open(path, "xb") as out:
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
