"""Reading and judging a run's commit markers: the raw bytes, the manifest they hold (checked
to name the step it sits at), and whether that checkpoint is one to resume from.

Functions of a location and a run's ``RunLayout``, so the run's handle (``RunStore``), the
writer and the leftovers share them without holding the store.
"""

from __future__ import annotations

from zephon.storage.backend import read_small
from zephon.storage.errors import CheckpointNotFoundError, CorruptCheckpointError
from zephon.storage.layout import CORRUPT_PREFIX, MARKER_NAME, RunLayout
from zephon.storage.lineage import Lineage
from zephon.storage.location import Location
from zephon.storage.manifest import Manifest

__all__ = [
    "describe",
    "describe_commit",
    "judge",
    "marker_bytes",
    "parse_marker",
    "read_manifest",
]


def judge(lineage: Lineage, manifest: Manifest, *, condemned: bool = False) -> str | None:
    """Why the checkpoint ``manifest`` describes is not one to resume from (abandoned or
    unregistered lineage, condemned), or None if it is. The storage half of the one rule
    every reader shares."""
    if condemned:
        return f"save {manifest.save_id} failed verification (a {CORRUPT_PREFIX} record)"
    return lineage.why_not(manifest.epoch, manifest.step)


def marker_bytes(location: Location, layout: RunLayout, step: int) -> bytes | None:
    """The raw bytes of the step's marker (one GET), or None if there is none."""
    try:
        return read_small(location, layout.marker_path(step))
    except FileNotFoundError:
        return None


def parse_marker(location: Location, layout: RunLayout, step: int, data: bytes) -> Manifest:
    """Validate a marker's bytes as the manifest of ``(run, step)``."""
    url = location.display(layout.checkpoint_path(step))
    manifest = Manifest.from_json(data, where=location.display(layout.marker_path(step)))
    if manifest.run != layout.run or manifest.step != step:
        raise CorruptCheckpointError(
            f"marker of {url} describes run {manifest.run!r} step {manifest.step}; it was "
            "copied or moved: checkpoints must stay where they were written",
            url=url,
            run=layout.run,
            step=step,
            problems=[f"{MARKER_NAME}: names run {manifest.run!r} step {manifest.step}"],
        )
    return manifest


def read_manifest(location: Location, layout: RunLayout, step: int) -> Manifest:
    """The manifest of a committed checkpoint; ``CheckpointNotFoundError`` if there is no
    marker, ``CorruptCheckpointError`` if it does not parse or names another checkpoint."""
    data = marker_bytes(location, layout, step)
    if data is None:
        url = location.display(layout.checkpoint_path(step))
        raise CheckpointNotFoundError(
            f"{url} is not a committed checkpoint (no {MARKER_NAME} marker); list the "
            f"run's checkpoints with `zephon checkpoints {layout.run or '<run>'}`",
            url=url,
            run=layout.run,
            step=step,
        )
    return parse_marker(location, layout, step, data)


def describe(manifest: Manifest) -> str:
    """``" (by host pid at time, epoch, save)"`` for messages about an existing commit."""
    writer = manifest.writer
    return (
        f" (by {writer.get('host', '?')} pid {writer.get('pid', '?')} at "
        f"{manifest.committed_at}, epoch {manifest.epoch}, save {manifest.save_id})"
    )


def describe_commit(
    location: Location, layout: RunLayout, step: int, *, marker: bytes | None = None
) -> str:
    """``describe`` of the step's marker (``marker``: its bytes, already read), for messages
    about an existing commit ("" if it cannot be read)."""
    try:
        if marker is not None:
            return describe(parse_marker(location, layout, step, marker))
        return describe(read_manifest(location, layout, step))
    except Exception:
        return ""
