"""Leftovers for gc: payload directories of saves that never committed (or were superseded),
loose files of uncommitted steps, and condemned saves kept for inspection."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from zephon.storage.backend import list_files, remove_dir, remove_empty_dirs, remove_files
from zephon.storage.errors import CheckpointNotFoundError, CorruptCheckpointError
from zephon.storage.layout import CORRUPT_PREFIX, MARKER_NAME, RunLayout
from zephon.storage.location import Location
from zephon.storage.markers import read_manifest
from zephon.storage.scan import scan_steps

__all__ = ["Orphan", "condemned_saves", "find_orphans", "remove_condemned", "remove_orphan"]


@dataclass(frozen=True, slots=True)
class Orphan:
    """A leftover old enough for gc to remove: one save's payload directory (``save_id``), or
    the loose files of an uncommitted step directory (``save_id`` None)."""

    run: str | None
    step: int
    save_id: str | None
    path: str
    url: str
    newest_mtime: float | None
    age_s: float


def find_orphans(
    location: Location,
    layouts: Iterable[RunLayout],
    older_than_s: float,
    *,
    now: float | None = None,
) -> list[Orphan]:
    """Leftovers whose newest object is older than ``older_than_s``: every payload
    directory of an uncommitted step (and its loose files), and payload directories of a
    committed step that its marker does not name (a superseded or stale attempt's save).
    Condemned saves are not orphans: they are kept for inspection (``condemned``).

    ``layouts`` are the runs searched (``CheckpointStore.orphans`` chooses them).
    """
    now = time.time() if now is None else now
    found = []

    def add(run: str | None, step: int, save_id: str | None, path: str, mtime) -> None:
        age = now - mtime if mtime is not None else float("inf")
        if age >= older_than_s:
            found.append(Orphan(run, step, save_id, path, location.display(path), mtime, age))

    for layout in layouts:
        run = layout.run
        for listing in scan_steps(location, layout.run_path, detail=True):
            saves = {k: v for k, v in listing.saves.items() if k not in listing.condemned}
            if listing.committed:
                if len(listing.saves) < 2:
                    continue  # the one payload directory is the marker's
                try:
                    keep = read_manifest(location, layout, listing.step).payload
                except (CorruptCheckpointError, CheckpointNotFoundError):
                    continue  # judged by whoever reads the marker, not by age
                saves.pop(keep, None)
            elif listing.loose or not listing.saves:
                add(run, listing.step, None, listing.path, listing.newest_mtime)
            for save_id, mtime in saves.items():
                add(run, listing.step, save_id, f"{listing.path}/{save_id}", mtime)
    return found


def remove_orphan(location: Location, layout: RunLayout, orphan: Orphan) -> None:
    """Delete one leftover found by ``orphans`` (``layout``: its run's): a payload directory,
    or the loose files of an uncommitted step (never a marker, a record or another save's
    directory)."""
    if orphan.save_id is not None:
        remove_files(location, [f.path for f in list_files(location, orphan.path)])
        remove_empty_dirs(location, orphan.path)
    else:
        step_path = orphan.path
        loose = [
            f.path
            for f in list_files(location, step_path)
            if "/" not in f.path[len(step_path) + 1 :]
            and f.path.rsplit("/", 1)[-1] != MARKER_NAME
            and not f.path.rsplit("/", 1)[-1].startswith(CORRUPT_PREFIX)
        ]
        remove_files(location, loose)
    remove_dir(location, layout.checkpoint_path(orphan.step))  # if now empty


def condemned_saves(location: Location, layout: RunLayout) -> list[tuple[int, str]]:
    """``(step, save_id)`` of every save a ``_CORRUPT`` record condemns (for
    ``zephon gc --corrupt``)."""
    listings = scan_steps(location, layout.run_path)
    return [(s.step, save) for s in listings for save in sorted(s.condemned)]


def remove_condemned(location: Location, layout: RunLayout, step: int, save_id: str) -> None:
    """Delete a condemned save: its marker if it is still the step's, its payload
    directory, then its ``_CORRUPT`` record (last, so a crash leaves it findable)."""
    step_path = layout.checkpoint_path(step)
    try:
        if read_manifest(location, layout, step).save_id == save_id:
            remove_files(location, [layout.marker_path(step)])
    except (CorruptCheckpointError, CheckpointNotFoundError):
        pass
    payload = layout.payload_path(step, save_id)
    remove_files(location, [f.path for f in list_files(location, payload)])
    remove_empty_dirs(location, payload)
    remove_files(location, [layout.record_path(step, save_id)])
    remove_dir(location, step_path)  # if now empty
