"""Removing chunk instances no checkpoint needs any more (deduplicated saves, docs/dedup.md).

The sweep of one run, in this order:

1. list the run's steps and read every marker present, whatever its epoch or lineage (a marker
   that is there keeps its chunks; whether it is still wanted is retention's call, made
   before: retention removes markers first, and their chunks become unreferenced);
2. only then list the chunk directory;
3. remove each instance that no marker of step 1 references and whose uploading save is over:
   - its attempt is fenced out (its epoch is older than the run's newest attempt): a stale
     attempt's chunks are garbage, never a reason to keep anything;
   - or it is one of ``finished``: saves the caller knows ended (the saves this very attempt
     committed, whose every chunk a marker named);
   - or it is older than ``older_than_s`` (a save still in flight is younger than that), and
     it is not one of the saves ``live`` names (a catalog knows every save in progress: a gc
     with a grace of 0 beside a saving job must spare them).

A save in flight references only chunks that it uploaded itself (younger than the limit, its
own epoch, not finished) or that its base lists, and its base is the newest checkpoint of its
history, which retention never deletes; so no instance a committed or committing checkpoint
names is ever removed, whatever is killed when. A marker that cannot be parsed stops the sweep
of the run: what it references is unknown.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from zephon.storage.backend import list_files, remove_files, sync_dirs
from zephon.storage.chunks import LEASE_DIR, chunk_epoch, lease_uploaders, parse_chunk_name
from zephon.storage.errors import CheckpointNotFoundError, CorruptCheckpointError
from zephon.storage.layout import RunLayout
from zephon.storage.location import Location
from zephon.storage.markers import read_manifest
from zephon.storage.scan import scan_steps

__all__ = ["ChunkSweep", "sweep_chunks"]


@dataclass(slots=True)
class ChunkSweep:
    """What one sweep of a run's chunks did."""

    removed: int = 0
    removed_bytes: int = 0
    #: unreferenced instances kept because their save may still be in flight
    kept_in_flight: int = 0
    #: instances some marker references
    referenced: int = 0
    #: why the run was not swept (an unreadable marker), else None
    skipped: str | None = None
    removed_names: list[str] = field(default_factory=list)


def sweep_chunks(
    location: Location,
    chunk_dir: str,
    layouts: Iterable[RunLayout],
    *,
    newest_epoch: int | None,
    older_than_s: float,
    finished: Collection[str] = (),
    now: float | None = None,
    executor: Executor | None = None,
    live: Callable[[], Collection[str]] | None = None,
) -> ChunkSweep:
    """Remove the unreferenced chunk instances of ``chunk_dir`` whose save is over (module
    docstring). ``layouts``: the runs whose markers may reference them (one run for a run's
    own chunks; every run of the store for the store's). ``newest_epoch``: the run's newest
    attempt (``Lineage.epoch``), read before the sweep; None where instances of several runs
    meet (their epochs are not comparable: only ``finished`` and the age apply).
    ``executor``: threads reading the markers and leases in parallel. ``live``: asked once the
    chunks are listed, the saves known to be in progress or kept (a catalog's live rows: a
    save's row exists before its first chunk), whose chunks are spared whatever their age."""
    result = ChunkSweep()
    if not list_files(location, chunk_dir):
        return result  # nothing was ever deduplicated here: one listing, nothing read
    steps = [
        (layout, listing.step)
        for layout in layouts
        for listing in scan_steps(location, layout.run_path)
        if listing.committed
    ]

    def references(target: tuple[RunLayout, int]) -> set[str] | str:
        layout, step = target
        try:
            manifest = read_manifest(location, layout, step)
        except CheckpointNotFoundError:
            return set()  # deleted since the listing: its chunks are unreferenced
        except CorruptCheckpointError as exc:
            where = location.display(layout.run_path)
            return f"the marker of step {step} of {where} cannot be read ({exc})"
        return {chunk.name for chunk in manifest.chunk_refs()}

    run_all = executor.map if executor is not None else map
    referenced: set[str] = set()
    for names in run_all(references, steps):
        if isinstance(names, str):
            result.skipped = names
            return result
        referenced.update(names)
    now = time.time() if now is None else now
    leases_prefix = f"{chunk_dir}/{LEASE_DIR}/"
    listed = list_files(location, chunk_dir)
    leases = [f for f in listed if f.path.startswith(leases_prefix)]
    doomed: list[tuple[str, int, str]] = []
    young: list[str] = []
    for lease in leases:
        if _age(now, lease.mtime) >= older_than_s:
            doomed.append((lease.path, lease.size, lease.path.rsplit("/", 1)[-1]))
        else:
            young.append(lease.path)

    def uploaders(path: str) -> set[str]:
        try:
            return lease_uploaders(location.backend.read_small(path)) or set()
        except FileNotFoundError:
            return set()  # removed since the listing: its save committed or gave up

    protected: set[str] = set(live()) if live is not None else set()
    for names in run_all(uploaders, young):
        protected.update(names)
    for entry in listed:
        name = entry.path.rsplit("/", 1)[-1]
        parsed = parse_chunk_name(name) if not entry.path.startswith(leases_prefix) else None
        if parsed is None:
            continue  # a lease, or not a chunk (a crashed write's temporary file)
        if name in referenced:
            result.referenced += 1
            continue
        save_id = parsed[1]
        if save_id in protected:
            result.kept_in_flight += 1
            continue
        epoch = chunk_epoch(save_id)
        over = (
            (newest_epoch is not None and epoch is not None and epoch < newest_epoch)
            or save_id in finished
            or _age(now, entry.mtime) >= older_than_s
        )
        if over:
            doomed.append((entry.path, entry.size, name))
        else:
            result.kept_in_flight += 1
    if doomed:
        remove_files(location, [path for path, _, _ in doomed])
        sync_dirs(location, [chunk_dir])
        chunks = [(size, name) for _, size, name in doomed if parse_chunk_name(name)]
        result.removed = len(chunks)
        result.removed_bytes = sum(size for size, _ in chunks)
        result.removed_names = sorted(name for _, name in chunks)
    return result


def _age(now: float, mtime: float | None) -> float:
    return now - mtime if mtime is not None else float("inf")
