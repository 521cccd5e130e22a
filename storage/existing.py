"""What a new save does with a marker already at its step, and condemnation records.

``begin`` and ``commit`` call ``settle_existing``: a complete checkpoint of the current history
is never overwritten, a newer epoch's marker means the caller is stale, and anything that is not
history (an abandoned or unregistered epoch, a damaged marker, a condemned save) is superseded
so the step can be saved. Only the current attempt supersedes, and only before creating its own
marker; gc and readers never delete a marker by path outside a catalog claim.
"""

from __future__ import annotations

import contextlib
import json
import time

from zephon.storage.backend import (
    create_settled,
    file_exists,
    list_files,
    make_dirs,
    remove_empty_dirs,
    remove_files,
    sync_dirs,
)
from zephon.storage.checksum import crc32c_of
from zephon.storage.errors import CommitConflictError, CorruptCheckpointError, FencedOutError
from zephon.storage.layout import RunLayout
from zephon.storage.lineage import AttemptRecord, Fence, Lineage, newer_epochs
from zephon.storage.location import Location
from zephon.storage.manifest import Manifest
from zephon.storage.markers import describe, marker_bytes, parse_marker

__all__ = [
    "UNREAD",
    "check_fence",
    "condemn",
    "is_condemned",
    "replace_marker",
    "settle_existing",
    "stale_error",
    "supersede",
    "write_record",
]


def stale_error(
    location: Location,
    layout: RunLayout,
    epoch: int,
    current: AttemptRecord | None,
    *,
    unfenced: bool = False,
) -> FencedOutError:
    """The error for a writer of ``epoch`` that ``current`` superseded (or, ``unfenced``, a
    writer without a fence on a fenced run), naming the current attempt."""
    run = layout.run
    url = location.display(layout.run_path)
    who = current.describe() if current is not None else "a newer attempt"
    if unfenced:
        message = (
            f"run {run or '(inference)'} at {url} is fenced: its current attempt is {who}; an "
            "unfenced writer cannot save into it: save through the run's current attempt "
            "(CheckpointManager registers one on start)"
        )
    else:
        message = (
            f"run {run or '(inference)'} at {url}: attempt epoch {epoch} is no longer current: "
            f"attempt {who} took over; this process is a stale attempt (a preempted job still "
            "running?): stop saving"
        )
    return FencedOutError(message, epoch=epoch, current=current, url=url, run=run)


def check_fence(location: Location, layout: RunLayout, fence: Fence) -> None:
    """Raise ``FencedOutError`` naming the current attempt if one newer than ``fence``
    registered (one listing of the run's attempt records)."""
    newer = newer_epochs(location, layout.run_path, fence.epoch)
    if newer is not None:
        raise stale_error(location, layout, fence.epoch, newer)


#: ``settle_existing``'s default: the marker has not been read yet
UNREAD = object()


def settle_existing(
    location: Location,
    layout: RunLayout,
    step: int,
    fence: Fence | None,
    lineage: Lineage,
    *,
    marker: bytes | None | object = UNREAD,
) -> bool:
    """Judge the marker at ``(run, step)`` for a new save; True if it was superseded (look
    again: another one may have appeared), False if the step is free. ``marker`` is its bytes
    (None: absent) when the caller already read them, e.g. alongside the fence check."""
    url = location.display(layout.checkpoint_path(step))
    data = marker_bytes(location, layout, step) if marker is UNREAD else marker
    if data is None:
        return False
    try:
        manifest = parse_marker(location, layout, step, data)
    except CorruptCheckpointError as exc:
        replace_marker(location, layout, step, None, data, f"damaged marker: {exc.problems[:1]}")
        return True
    epoch = fence.epoch if fence is not None else 0
    if manifest.epoch > epoch:
        current = newer_epochs(location, layout.run_path, epoch)
        raise stale_error(location, layout, epoch, current)
    why_not = lineage.why_not(manifest.epoch, step)
    condemned = is_condemned(location, layout, step, manifest.save_id)
    if why_not is None and not condemned:
        raise CommitConflictError(
            f"{url} is already committed{describe(manifest)}; a committed step is never "
            "overwritten: save under a new step, or delete that checkpoint first",
            url=url,
            run=layout.run,
            step=step,
        )
    replace_marker(location, layout, step, manifest, data, why_not or "condemned")
    return True


def supersede(
    location: Location, layout: RunLayout, step: int, fence: Fence, *, marker: bytes | None
) -> None:
    """For a commit that found another save's marker at its step: supersede it if it is not
    part of ``fence``'s history, so the commit can be tried again (``RunStore.supersede``)."""
    check_fence(location, layout, fence)
    settle_existing(
        location, layout, step, fence, fence.lineage, marker=UNREAD if marker is None else marker
    )


def replace_marker(
    location: Location,
    layout: RunLayout,
    step: int,
    manifest: Manifest | None,
    data: bytes,
    why: str,
) -> None:
    """Remove a marker that is not part of the current history so the step can be saved.

    A damaged or condemned checkpoint keeps its payload and a ``_CORRUPT`` record (holding
    its marker's bytes) for inspection until ``zephon gc --corrupt``; a checkpoint of an
    abandoned history is garbage and goes with its payload directory.
    """
    step_path = layout.checkpoint_path(step)
    keep = manifest is None or why == "condemned"
    if keep:
        key = manifest.save_id if manifest is not None else f"marker-{crc32c_of(data)}"
        write_record(location, layout, step, key, why, data)
    remove_files(location, [layout.marker_path(step)])
    sync_dirs(location, [step_path])
    if not keep and manifest is not None and manifest.payload:
        payload = layout.payload_path(step, manifest.payload)
        remove_files(location, [f.path for f in list_files(location, payload)])
        remove_empty_dirs(location, payload)


def condemn(
    location: Location, layout: RunLayout, step: int, manifest: Manifest, reason: str
) -> None:
    """Record that the save ``manifest`` describes failed verification: a
    ``_CORRUPT.<save_id>`` record (reason and marker) beside it. From then on no reader
    takes it as latest; it stays for inspection until ``zephon gc --corrupt``. Idempotent;
    nothing is deleted."""
    write_record(location, layout, step, manifest.save_id, reason, manifest.to_json())


def write_record(
    location: Location, layout: RunLayout, step: int, key: str, why: str, data: bytes
) -> None:
    record = json.dumps(
        {"reason": why, "at": time.time(), "marker": data.decode("utf-8", "replace")},
        sort_keys=True,
    ).encode("utf-8")
    make_dirs(location, layout.checkpoint_path(step))
    with contextlib.suppress(FileExistsError):
        # one there already (any reason) will do
        create_settled(location, layout.record_path(step, key), record)


def is_condemned(location: Location, layout: RunLayout, step: int, save_id: str) -> bool:
    """Whether a ``_CORRUPT`` record condemns save ``save_id`` of the step (one request)."""
    return file_exists(location, layout.record_path(step, save_id))
