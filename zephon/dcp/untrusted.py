"""What stands between a checkpoint's bytes and a DCP planner: no code runs from storage.

A bucket may be writable by others, so a checkpoint is untrusted input. torch's own
``DefaultLoadPlanner`` unpickles non-tensor ("bytes") items with ``weights_only=False``; the
reader therefore never hands a planner the stored bytes of such an item. ``restricted_load`` is
the one restricted unpickler (``ZephonLoadPlanner`` uses it too); ``deliver_bytes`` gives a
planner only what it rebuilt; ``check_read_kind`` and ``kind_problem`` refuse a tensor
relabelled as a non-tensor item (or back), which would reach the planner through the other path.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from zephon.dcp.errors import UnsafeItemError
from zephon.dcp.metadata_codec import ShardSlice

__all__ = ["check_read_kind", "deliver_bytes", "kind_problem", "restricted_load"]

#: lines of torch's weights_only message that are advice, not the reason
_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def restricted_load(data: bytes | bytearray | memoryview, *, key: str, where: str | None) -> Any:
    """The object the non-tensor item ``key`` of checkpoint ``where`` holds, rebuilt with
    ``torch.load(weights_only=True)``: only tensors, plain containers, numbers and the types
    registered with ``torch.serialization.add_safe_globals``, so a tampered checkpoint cannot
    run code. Anything else raises ``UnsafeItemError`` naming the item (nothing of it ran)."""
    try:
        return torch.load(io.BytesIO(bytes(data)), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every refusal becomes one error naming the item
        reason = _reason(exc)
    checkpoint = f"checkpoint {where}" if where else "the checkpoint"
    raise UnsafeItemError(
        f"non-tensor item {key!r} of {checkpoint} is refused: the restricted unpickler "
        f"(weights_only) does not accept it ({reason}), so nothing of it was run; a checkpoint "
        "from storage others can write may be tampered with: if this one is trusted and holds "
        "plain data, register its types with torch.serialization.add_safe_globals",
        key=key,
        url=where,
    )


def _reason(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = [line for line in lines if line and not line.startswith(_ADVICE)]
    return (kept[0] if kept else type(exc).__name__)[:200]


def deliver_bytes(
    planner: LoadPlanner,
    req: ReadItem,
    data: bytes | bytearray | memoryview,
    *,
    where: str,
    lock: threading.Lock,
) -> None:
    """Hand the non-tensor item ``req`` to ``planner``, rebuilt by ``restricted_load`` first (a
    refusal raises ``UnsafeItemError`` before the planner sees anything)."""
    from zephon.dcp.planner import ZephonLoadPlanner

    obj = restricted_load(data, key=req.dest_index.fqn, where=where)
    with lock:
        if type(planner).load_bytes is ZephonLoadPlanner.load_bytes:
            planner.load_object(req, obj)
        else:
            # Whatever this planner does with the bytes (DefaultLoadPlanner: torch.load with
            # weights_only=False), they are a pickle written here of the object the
            # restricted unpickler rebuilt: none of the checkpoint's own pickle reaches it.
            out = io.BytesIO()
            torch.save(obj, out)
            out.seek(0)
            planner.load_bytes(req, out)


def kind_problem(index: Any, where: ShardSlice, md: Any) -> str | None:
    """Why the slice of ``index`` disagrees with its item's kind in the metadata, if it does."""
    if isinstance(md, BytesStorageMetadata) and where.encoding != "bytes":
        return f"{where.file}: {index.fqn} is a non-tensor item stored as {where.encoding}"
    if isinstance(md, TensorStorageMetadata) and where.encoding != "raw":
        return f"{where.file}: {index.fqn} is a tensor stored as {where.encoding}"
    return None


def check_read_kind(req: ReadItem, where: ShardSlice, planner: LoadPlanner, *, url: str) -> None:
    """Refuse a read whose bytes would reach the planner as something else than the item is: a
    tensor read of a bytes slice (the planner would unpickle it), or a bytes read into a tensor
    of the state dict (a tensor entry the metadata relabelled "bytes")."""
    fqn = req.dest_index.fqn
    is_bytes = req.type == LoadItemType.BYTE_IO
    state = getattr(planner, "state_dict", None)
    here = state.get(fqn) if is_bytes and isinstance(state, dict) else None
    if is_bytes == (where.encoding == "bytes") and not isinstance(here, torch.Tensor):
        return
    saved = "a non-tensor item" if where.encoding == "bytes" else "a tensor"
    wanted = "a tensor" if isinstance(here, torch.Tensor) or not is_bytes else "not a tensor"
    raise UnsafeItemError(
        f"item {fqn!r} is {wanted} here, but the metadata of checkpoint {url} stores it as "
        f"{saved} ({where.file}): refused, nothing of it was loaded; the checkpoint was "
        "tampered with or saved from another model: resume from an earlier checkpoint",
        key=fqn,
        url=url,
    )
