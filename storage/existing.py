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
from typing import TYPE_CHECKING

from storage.backend import (
    create_settled,
    file_exists,
    list_files,
    make_dirs,
    remove_empty_dirs,
    remove_files,
    sync_dirs,
)
from storage.checksum import crc32c_of
from storage.errors import CommitConflictError, CorruptCheckpointError, FencedOutError
from storage.layout import CORRUPT_PREFIX
from storage.lineage import AttemptRecord, Fence, Lineage, newer_epochs
from storage.manifest import Manifest

if TYPE_CHECKING:
    from storage.store import CheckpointStore

__all__ = [
    "UNREAD",
    "condemn",
    "describe",
    "is_condemned",
    "replace_marker",
    "settle_existing",
    "stale_error",
    "write_record",
]


def describe(manifest: Manifest) -> str:
    """``" (by host pid at time, epoch, save)"`` for messages about an existing commit."""
    writer = manifest.writer
    return (
        f" (by {writer.get('host', '?')} pid {writer.get('pid', '?')} at "
        f"{manifest.committed_at}, epoch {manifest.epoch}, save {manifest.save_id})"
    )


def stale_error(
    store: CheckpointStore,
    run: str | None,
    epoch: int,
    current: AttemptRecord | None,
    *,
    unfenced: bool = False,
) -> FencedOutError:
    """The error for a writer of ``epoch`` that ``current`` superseded (or, ``unfenced``, a
    writer without a fence on a fenced run), naming the current attempt."""
    url = store.location.display(store.run(run).run_path())
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


#: ``settle_existing``'s default: the marker has not been read yet
UNREAD = object()


def settle_existing(
    store: CheckpointStore,
    run: str | None,
    step: int,
    fence: Fence | None,
    lineage: Lineage,
    *,
    marker: bytes | None | object = UNREAD,
) -> bool:
    """Judge the marker at ``(run, step)`` for a new save; True if it was superseded (look
    again: another one may have appeared), False if the step is free. ``marker`` is its bytes
    (None: absent) when the caller already read them, e.g. alongside the fence check."""
    url = store.run(run).checkpoint_url(step)
    data = store.run(run).marker_bytes(step) if marker is UNREAD else marker
    if data is None:
        return False
    try:
        manifest = store.run(run).parse_marker(step, data)
    except CorruptCheckpointError as exc:
        replace_marker(store, run, step, None, data, f"damaged marker: {exc.problems[:1]}")
        return True
    epoch = fence.epoch if fence is not None else 0
    if manifest.epoch > epoch:
        current = newer_epochs(store.location, store.run(run).run_path(), epoch)
        raise stale_error(store, run, epoch, current)
    why_not = lineage.why_not(manifest.epoch, step)
    condemned = is_condemned(store, run, step, manifest.save_id)
    if why_not is None and not condemned:
        raise CommitConflictError(
            f"{url} is already committed{describe(manifest)}; a committed step is never "
            "overwritten: save under a new step, or delete that checkpoint first",
            url=url,
            run=run,
            step=step,
        )
    replace_marker(store, run, step, manifest, data, why_not or "condemned")
    return True


def replace_marker(
    store: CheckpointStore,
    run: str | None,
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
    location = store.location
    step_path = store.run(run).checkpoint_path(step)
    keep = manifest is None or why == "condemned"
    if keep:
        key = manifest.save_id if manifest is not None else f"marker-{crc32c_of(data)}"
        write_record(store, run, step, key, why, data)
    remove_files(location, [store.run(run).marker_path(step)])
    sync_dirs(location, [step_path])
    if not keep and manifest is not None and manifest.payload:
        payload = f"{step_path}/{manifest.payload}"
        remove_files(location, [f.path for f in list_files(location, payload)])
        remove_empty_dirs(location, payload)


def condemn(
    store: CheckpointStore, run: str | None, step: int, manifest: Manifest, reason: str
) -> None:
    """Record that the save ``manifest`` describes failed verification: a
    ``_CORRUPT.<save_id>`` record (reason and marker) beside it. From then on no reader
    takes it as latest; it stays for inspection until ``zephon gc --corrupt``. Idempotent;
    nothing is deleted."""
    write_record(store, run, step, manifest.save_id, reason, manifest.to_json())


def write_record(
    store: CheckpointStore, run: str | None, step: int, key: str, why: str, data: bytes
) -> None:
    record = json.dumps(
        {"reason": why, "at": time.time(), "marker": data.decode("utf-8", "replace")},
        sort_keys=True,
    ).encode("utf-8")
    path = f"{store.run(run).checkpoint_path(step)}/{CORRUPT_PREFIX}{key}"
    location = store.location
    make_dirs(location, store.run(run).checkpoint_path(step))
    with contextlib.suppress(FileExistsError):
        create_settled(location, path, record)  # one there already (any reason) will do


def is_condemned(store: CheckpointStore, run: str | None, step: int, save_id: str) -> bool:
    """Whether a ``_CORRUPT`` record condemns save ``save_id`` of the step (one request)."""
    path = f"{store.run(run).checkpoint_path(step)}/{CORRUPT_PREFIX}{save_id}"
    return file_exists(store.location, path)
