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
   - or it is older than ``older_than_s`` (a save still in flight is younger than that).

A save in flight references only chunks that it uploaded itself (younger than the limit, its
own epoch, not finished) or that its base lists, and its base is the newest checkpoint of its
history, which retention never deletes; so no instance a committed or committing checkpoint
names is ever removed, whatever is killed when. A marker that cannot be parsed stops the sweep
of the run: what it references is unknown.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from concurrent.futures import Executor
from dataclasses import dataclass, field

from zephon.storage.backend import list_files, remove_files, sync_dirs
from zephon.storage.chunks import chunk_epoch, parse_chunk_name
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
    layout: RunLayout,
    *,
    newest_epoch: int,
    older_than_s: float,
    finished: Collection[str] = (),
    now: float | None = None,
    executor: Executor | None = None,
) -> ChunkSweep:
    """Remove the run's unreferenced chunk instances whose save is over (module docstring).
    ``newest_epoch``: the run's newest attempt (``Lineage.epoch``), read before the sweep;
    ``executor``: threads reading the markers in parallel."""
    result = ChunkSweep()
    if not list_files(location, layout.chunk_dir):
        return result  # a run that never deduplicated: one listing, nothing read
    referenced: set[str] = set()
    steps = [listing.step for listing in scan_steps(location, layout.run_path) if listing.committed]

    def references(step: int) -> set[str] | str:
        try:
            manifest = read_manifest(location, layout, step)
        except CheckpointNotFoundError:
            return set()  # deleted since the listing: its chunks are unreferenced
        except CorruptCheckpointError as exc:
            return f"the marker of step {step} cannot be read ({exc})"
        return {chunk.name for chunk in manifest.chunk_refs()}

    found = executor.map(references, steps) if executor is not None else map(references, steps)
    for names in found:
        if isinstance(names, str):
            result.skipped = names
            return result
        referenced.update(names)
    now = time.time() if now is None else now
    doomed: list[tuple[str, int, str]] = []
    for listed in list_files(location, layout.chunk_dir):
        name = listed.path.rsplit("/", 1)[-1]
        parsed = parse_chunk_name(name)
        if parsed is None:
            continue  # not a chunk (a crashed write's temporary file is the backend's)
        if name in referenced:
            result.referenced += 1
            continue
        save_id = parsed[1]
        epoch = chunk_epoch(save_id)
        age = now - listed.mtime if listed.mtime is not None else float("inf")
        over = (
            (epoch is not None and epoch < newest_epoch)
            or save_id in finished
            or age >= older_than_s
        )
        if over:
            doomed.append((listed.path, listed.size, name))
        else:
            result.kept_in_flight += 1
    if doomed:
        remove_files(location, [path for path, _, _ in doomed])
        sync_dirs(location, [layout.chunk_dir])
        result.removed = len(doomed)
        result.removed_bytes = sum(size for _, size, _ in doomed)
        result.removed_names = [name for _, _, name in doomed]
    return result
