"""Finding the step directories of a run, and which are committed, with as few requests as
the backend allows.

Object stores: one recursive, paged listing of the run's prefix; the markers are in it, so no
per-step request is made. POSIX: one directory read plus a ``stat`` of each step's marker (a
local stat costs microseconds; a directory read would not say whether the marker exists).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from storage.backend import SERVER_SIDE_PREFIX, backend_errors, list_files, mtime_of
from storage.layout import MARKER_NAME, STEP_PREFIX, parse_step_dirname
from storage.location import Location

__all__ = ["StepListing", "scan_steps", "newest_mtime_local"]


@dataclass(frozen=True, slots=True)
class StepListing:
    """One ``save-<step>`` directory as a listing saw it."""

    step: int
    path: str
    committed: bool
    #: newest modification time of anything in the directory (epoch seconds), None if unknown
    newest_mtime: float | None = None


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


def scan_steps(location: Location, base: str, *, with_ages: bool = False) -> list[StepListing]:
    """Every ``save-<step>`` directory directly under ``base``, sorted by step.

    ``with_ages`` also fills ``newest_mtime`` (for orphan detection); on object stores it comes
    free with the listing, on POSIX it walks only the uncommitted directories.
    """
    with backend_errors(location, f"listing {location.display(base)}"):
        if location.is_local:
            return _scan_posix(base, with_ages)
        return _scan_listing(location, base)


def _scan_posix(base: str, with_ages: bool) -> list[StepListing]:
    try:
        entries = list(os.scandir(base))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for entry in entries:
        step = parse_step_dirname(entry.name)
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        committed = os.path.exists(os.path.join(entry.path, MARKER_NAME))
        age = newest_mtime_local(entry.path) if with_ages and not committed else None
        out.append(StepListing(step, entry.path, committed, age))
    return sorted(out, key=lambda s: s.step)


def _scan_listing(location: Location, base: str) -> list[StepListing]:
    fs = location.fs
    if location.protocol in SERVER_SIDE_PREFIX:
        # Only keys under <base>/save-..., filtered by the server.
        try:
            found = fs.find(base, detail=True, withdirs=False, prefix=STEP_PREFIX)
        except FileNotFoundError:
            found = {}
        files = [(name, info) for name, info in found.items() if info.get("type") != "directory"]
        listed = [(name, mtime_of(info)) for name, info in files]
    else:
        listed = [(f.path, f.mtime) for f in list_files(location, base)]
    prefix = base.rstrip("/") + "/"
    steps: dict[int, list] = {}
    for name, mtime in listed:
        if not name.startswith(prefix):
            continue
        dirname, _, rest = name[len(prefix) :].partition("/")
        step = parse_step_dirname(dirname)
        if step is None or not rest:
            continue
        state = steps.setdefault(step, [False, None])
        if rest == MARKER_NAME:
            state[0] = True
        if mtime is not None and (state[1] is None or mtime > state[1]):
            state[1] = mtime
    return [
        StepListing(step, f"{prefix}{STEP_PREFIX}{step}", committed, newest)
        for step, (committed, newest) in sorted(steps.items())
    ]
