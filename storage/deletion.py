"""Deleting committed checkpoints of one run: markers first (none is complete any more
before any payload goes), then the payload in batched requests, then the directories."""

from __future__ import annotations

from collections.abc import Iterable

from zephon.storage.backend import list_files, remove_empty_dirs, remove_files, sync_dirs
from zephon.storage.layout import RunLayout, validate_step
from zephon.storage.location import Location

__all__ = ["delete_checkpoints"]


def delete_checkpoints(
    location: Location, layout: RunLayout, steps: Iterable[int]
) -> dict[int, int]:
    """Delete the checkpoints ``steps`` of the run ``layout`` places, with as few requests as
    the backend allows (``RunStore.delete_many``). Idempotent; finishes a delete that crashed.
    Returns step -> payload files removed."""
    ordered = sorted({validate_step(s) for s in steps})
    if not ordered:
        return {}
    remove_files(location, [layout.marker_path(step) for step in ordered])
    # the markers' removal is durable before any payload goes (local disk: fsync)
    sync_dirs(location, [layout.checkpoint_path(step) for step in ordered])
    payload = _payload_of(location, layout, ordered)
    remove_files(location, [path for paths in payload.values() for path in paths])
    for step in ordered:
        remove_empty_dirs(location, layout.checkpoint_path(step))
    return {step: len(payload[step]) for step in ordered}


def _payload_of(location: Location, layout: RunLayout, steps: list[int]) -> dict[int, list[str]]:
    """Every file below each step directory: one listing of the run for several steps (on
    object stores the inference layout's root is listed per step instead: it may hold more
    than checkpoints)."""
    if len(steps) == 1:
        path = layout.checkpoint_path(steps[0])
        return {steps[0]: [f.path for f in list_files(location, path)]}
    wanted = {f"{layout.checkpoint_path(step)}/": step for step in steps}
    found: dict[int, list[str]] = {step: [] for step in steps}
    base = layout.run_path
    listing = (
        list_files(location, base)
        if layout.run is not None or location.backend.posix_paths
        else [f for step in steps for f in list_files(location, layout.checkpoint_path(step))]
    )
    for listed in listing:
        head = listed.path[len(base) + 1 :].split("/", 1)[0]
        step = wanted.get(f"{base}/{head}/")
        if step is not None:
            found[step].append(listed.path)
    return found
