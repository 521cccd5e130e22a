"""Finding the step directories of a run, what each holds (marker, condemnation records, the
payload directories of its saves), with as few requests as the backend allows.

Object stores: one recursive, paged listing of the run's ``save-*`` keys; the markers, records
and payload directories are all in it, so no per-step request is made. POSIX: one directory
read plus a ``stat`` of each step's marker (a local stat costs microseconds); ``detail`` also
reads each step directory and the ages of its saves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from zephon.storage.backend import list_files
from zephon.storage.layout import CORRUPT_PREFIX, MARKER_NAME, STEP_PREFIX, parse_step_dirname
from zephon.storage.location import Location
from zephon.storage.manifest import SAVE_ID

__all__ = ["StepListing", "scan_steps", "newest_mtime_local"]


@dataclass(frozen=True, slots=True)
class StepListing:
    """One ``save-<step>`` directory as a listing saw it."""

    step: int
    path: str
    committed: bool
    #: newest modification time of anything in the directory (epoch seconds), None if unknown
    newest_mtime: float | None = None
    #: payload directories (save ids) found, each with the newest mtime of its files
    saves: dict[str, float | None] = field(default_factory=dict)
    #: save ids that a ``_CORRUPT.<save_id>`` record condemns
    condemned: frozenset[str] = frozenset()
    #: whether files other than the marker, records and save directories are present (a
    #: format-1 checkpoint's payload, or a crashed marker write's temp file)
    loose: bool = False


def newest_mtime_local(path: str) -> float | None:
    newest = None
    for dirpath, _dirs, files in os.walk(path):
        for name in [*files, ""]:
            try:
                mtime = os.stat(os.path.join(dirpath, name) if name else dirpath).st_mtime
            except OSError:
                continue
            newest = mtime if newest is None else max(newest, mtime)
    return newest


def scan_steps(location: Location, base: str, *, detail: bool = False) -> list[StepListing]:
    """Every ``save-<step>`` directory directly under ``base``, sorted by step.

    ``detail`` also fills ``newest_mtime``, ``saves`` and ``loose`` on POSIX (object stores
    always have them, free with the listing); ``condemned`` is always filled.
    """
    if location.backend.posix_paths:  # a directory read and a stat per step: microseconds
        return _scan_posix(location.backend.entries(base), detail)  # type: ignore[attr-defined]
    return _scan_listing(location, base)


def _classify(step: int, path: str, names: list[tuple[str, float | None]]) -> StepListing:
    """A step directory from ``(path below it, mtime)`` pairs."""
    committed, loose, newest = False, False, None
    saves: dict[str, float | None] = {}
    condemned = set()
    for rest, mtime in names:
        if mtime is not None and (newest is None or mtime > newest):
            newest = mtime
        head, sep, _tail = rest.partition("/")
        if not sep:
            if head == MARKER_NAME:
                committed = True
            elif head.startswith(CORRUPT_PREFIX):
                condemned.add(head[len(CORRUPT_PREFIX) :])
            else:
                loose = True
            continue
        if SAVE_ID.fullmatch(head):
            known = saves.get(head)
            saves[head] = mtime if known is None or (mtime is not None and mtime > known) else known
        else:
            loose = True
    return StepListing(step, path, committed, newest, saves, frozenset(condemned), loose)


def _scan_posix(entries: list[os.DirEntry], detail: bool) -> list[StepListing]:
    out = []
    for entry in entries:
        step = parse_step_dirname(entry.name)
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        if not detail:
            names = []
            try:
                children = os.listdir(entry.path)
            except OSError:
                children = []
            names = [
                (n, None) for n in children if n == MARKER_NAME or n.startswith(CORRUPT_PREFIX)
            ]
            out.append(_classify(step, entry.path, names))
            continue
        names = []
        for dirpath, _dirs, files in os.walk(entry.path):
            relative = os.path.relpath(dirpath, entry.path)
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    mtime = os.stat(full).st_mtime
                except OSError:
                    continue
                names.append((name if relative == "." else f"{relative}/{name}", mtime))
        listing = _classify(step, entry.path, names)
        if listing.newest_mtime is None:  # an empty directory: its own age
            try:
                mtime = os.stat(entry.path).st_mtime
            except OSError:
                mtime = None
            listing = StepListing(step, entry.path, False, mtime)
        out.append(listing)
    return sorted(out, key=lambda s: s.step)


def _scan_listing(location: Location, base: str) -> list[StepListing]:
    # Only keys under <base>/save-..., filtered by the server where it can.
    listed = [(f.path, f.mtime) for f in list_files(location, base, prefix=STEP_PREFIX)]
    prefix = base.rstrip("/") + "/"
    steps: dict[int, list[tuple[str, float | None]]] = {}
    for name, mtime in listed:
        if not name.startswith(prefix):
            continue
        dirname, _, rest = name[len(prefix) :].partition("/")
        step = parse_step_dirname(dirname)
        if step is None or not rest:
            continue
        steps.setdefault(step, []).append((rest, mtime))
    return [
        _classify(step, f"{prefix}{STEP_PREFIX}{step}", names)
        for step, names in sorted(steps.items())
    ]
