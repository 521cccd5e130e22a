"""Calling DCP with Zephon's writer and reader: collective helpers that turn DCP's
``CheckpointException`` (a BaseException carrying one exception per failing rank) into the
Zephon or storage error that caused it, so callers can ``except Exception`` as usual.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from zephon.dcp.errors import WriterSetupError
from zephon.dcp.planner import ZephonLoadPlanner
from zephon.dcp.reader import ZephonStorageReader
from zephon.dcp.staging import ZephonStager
from zephon.dcp.writer import ZephonStorageWriter
from zephon.errors import as_zephon_error
from zephon.storage import CheckpointStore, CheckpointWriter

__all__ = ["as_zephon_error", "async_save", "attach_ranks", "load", "ranges_read", "save"]

# Without torch.distributed a single process is what the caller asked for (a one-process job,
# an export); DCP warns about it on every call, also from the threads of an async save, so the
# filter is process-wide and matches only that message.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is (disabled|unavailable)",
    category=UserWarning,
)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _no_dist(process_group: Any) -> bool:
    return process_group is None and not _distributed()


def save(
    state_dict: dict[str, Any],
    writer: ZephonStorageWriter,
    *,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    checkpoint_id: str | os.PathLike | None = None,
) -> Metadata:
    """Collective (all ranks of ``process_group``): ``dcp.save`` through ``writer``; the
    checkpoint is committed when this returns. Failures raise the causing Zephon/storage error
    or ``DistributedCheckpointError``, on every rank. ``checkpoint_id`` is handed to DCP, which
    gives it to ``writer.reset`` (a ``zephon.dcp.Writer`` takes the step from it)."""
    no_dist = _no_dist(process_group)
    try:
        return dcp.save(
            state_dict,
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
            checkpoint_id=checkpoint_id,
        )
    except BaseException as exc:
        writer._save_failed(exc)
        if isinstance(exc, CheckpointException):
            raise as_zephon_error(exc, where=writer.url) from exc
        raise


def async_save(
    state_dict: dict[str, Any],
    writer: ZephonStorageWriter,
    *,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    stager: ZephonStager | None = None,
    checkpoint_id: str | os.PathLike | None = None,
) -> Future[Metadata]:
    """Collective: stage ``state_dict`` into host memory (a copy, so later in-place updates do
    not reach the checkpoint), then write and commit in a background thread.

    Returns once staging is done. The future completes with the DCP metadata once committed, or
    fails with the translated error. Use a process group reserved for checkpointing (e.g.
    ``dist.new_group(backend="gloo")``): the background thread runs collectives on it while
    training goes on. With a long-lived ``stager`` the copy goes into the buffers of the previous
    save (after waiting for that save to finish), which is several times faster than DCP's
    default of fresh memory each time.
    """
    if stager is not None:
        stager.wait_idle()
    response = dcp.async_save(
        state_dict,
        storage_writer=writer,
        planner=planner,
        process_group=process_group,
        async_stager=stager,
        no_dist=_no_dist(process_group),
        checkpoint_id=checkpoint_id,
    )
    upload: Future = getattr(response, "upload_completion", response)
    result: Future[Metadata] = Future()

    def settle(done: Future) -> None:
        try:
            result.set_result(done.result())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            writer._save_failed(exc)
            result.set_exception(as_zephon_error(exc, where=writer.url))

    if stager is not None:
        stager.track(result)
    upload.add_done_callback(settle)
    return result


def load(
    state_dict: dict[str, Any],
    reader: ZephonStorageReader,
    *,
    planner: LoadPlanner | None = None,
    allow_partial_load: bool = False,
    process_group: dist.ProcessGroup | None = None,
    checkpoint_id: str | os.PathLike | None = None,
) -> None:
    """Collective: ``dcp.load`` through ``reader`` into ``state_dict`` in place (``Stateful``
    values get ``load_state_dict``). Uses ``ZephonLoadPlanner`` unless a planner is given, so a
    mismatch raises ``StateDictMismatchError`` naming the keys; an uncommitted or damaged
    checkpoint raises the storage error naming it or its file."""
    if planner is None:
        planner = ZephonLoadPlanner(allow_partial_load=allow_partial_load, where=reader.url)
    no_dist = _no_dist(process_group)
    try:
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
            checkpoint_id=checkpoint_id,
        )
    except CheckpointException as exc:
        raise as_zephon_error(exc, where=reader.url, local_failure=reader.failure) from exc


def ranges_read(
    state_dict: dict[str, Any], reader: ZephonStorageReader, *, allow_partial_load: bool = False
) -> dict[str, list[tuple[int, int]]]:
    """What ``load(state_dict, reader)`` on this rank will read of the checkpoint's shard
    files, as its own planner chooses: for each file, the ``(offset, length)`` of every saved
    item it reads whole (a checked read covers the whole item, to check its CRC32C), sorted.
    Reads the metadata (kept by ``reader`` for the load that follows). Lets a copy that is not
    whole in one place (the memory tier's resume on a node) bring only what this rank needs."""
    metadata = reader.read_metadata()
    planner = ZephonLoadPlanner(allow_partial_load=allow_partial_load, where=reader.url)
    planner.set_up_planner(dict(state_dict), metadata, is_coordinator=False)
    slices = metadata.storage_data
    spans: dict[str, set[tuple[int, int]]] = {}
    for item in planner.create_local_plan().items:
        where = slices.get(item.storage_index)
        if where is not None:  # a missing item is the load's to report, naming it
            spans.setdefault(where.file, set()).add((where.offset, where.length))
    return {file: sorted(found) for file, found in sorted(spans.items())}


def attach_ranks(
    store: CheckpointStore,
    run: str | None,
    step: int,
    primary: CheckpointWriter | None,
    *,
    process_group: dist.ProcessGroup | None = None,
    coordinator: int = 0,
) -> CheckpointWriter:
    """Collective: give every rank its writer for checkpoint ``(run, step)``.

    The coordinator rank (``coordinator`` within ``process_group``) passes the primary writer it
    got from ``store.run(run).begin(step)``, or None if ``begin`` failed (every rank then raises);
    the other ranks pass None and get ``store.attach(...)`` with the coordinator's save id.
    The broadcast hands out the save id ``begin`` drew, so no rank writes before ``begin``
    checked the fence and settled a marker already at the step. Without torch.distributed,
    returns ``primary``.
    """
    if not _distributed():
        if primary is None:
            raise WriterSetupError(f"no primary writer for run {run!r} step {step}")
        return primary
    is_coordinator = dist.get_rank(process_group) == coordinator
    if is_coordinator and primary is not None and not primary.primary:
        raise WriterSetupError(
            f"attach_ranks needs the primary writer of {primary.url} on the coordinator"
        )
    message: list[Mapping[str, Any] | None] = [
        {"save_id": primary.save_id if primary is not None else None} if is_coordinator else None
    ]
    src = (
        dist.get_global_rank(process_group, coordinator)
        if process_group is not None
        else coordinator
    )
    dist.broadcast_object_list(message, src=src, group=process_group)
    save_id = (message[0] or {}).get("save_id")
    if save_id is None:
        raise WriterSetupError(
            f"the coordinator could not begin checkpoint {store.run(run).checkpoint_url(step)}; "
            "see the coordinator's error, fix it and save again"
        )
    if is_coordinator:
        assert primary is not None
        return primary
    return store.run(run).attach(step, save_id=save_id)
