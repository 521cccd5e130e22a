"""What stands between a checkpoint's bytes and a DCP planner: no code runs from storage.

A bucket may be writable by others, so a checkpoint is untrusted input. torch's own
``DefaultLoadPlanner`` unpickles non-tensor ("bytes") items with ``weights_only=False``; the
reader therefore never hands a planner the stored bytes of such an item. ``restricted_load`` is
the one restricted unpickler (``ZephonLoadPlanner`` uses it too); ``deliver_bytes`` gives a
planner only what it rebuilt; ``check_read_kind`` and ``kind_problem`` refuse a tensor
relabelled as a non-tensor item (or back), which would reach the planner through the other path.
``unpickle_allowed`` is the one allowlist unpickler for pickles that are not ``torch.save``
files (a stock checkpoint's ``.metadata``, the ``data.pkl`` inside each of its tensor blobs:
``zephon.dcp.stock_loader``): only the globals its caller names are ever looked up.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from zephon.dcp.errors import UnsafeItemError
from zephon.dcp.metadata_codec import ShardSlice

__all__ = [
    "UnpickleRefused",
    "check_read_kind",
    "deliver_bytes",
    "kind_problem",
    "restricted_load",
    "unpickle_allowed",
]

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


class UnpickleRefused(Exception):
    """Raised by ``unpickle_allowed``: the pickle is not one it accepts (the message says why);
    callers turn it into their own error naming the file."""


class _AllowlistUnpickler(pickle._Unpickler):  # the Python one: its BUILD can be guarded
    """An unpickler whose ``find_class`` answers only from an allowlist: every global a pickle
    can call (``REDUCE``, ``NEWOBJ``, the copyreg extension codes) is reached through
    ``find_class``, so nothing outside the allowlist is imported or run. ``BUILD`` (setting an
    object's state) is allowed only on instances of the ``buildable`` classes, which the
    pickle itself created: never on a class, a function or a shared object such as an enum
    member, whose change would outlive the load."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        allowed: Callable[[str, str], Any],
        persistent: Callable[[Any], Any] | None,
        buildable: tuple[type, ...],
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._persistent = persistent
        self._buildable = buildable

    def _load_build(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if type(target) not in self._buildable:
            raise UnpickleRefused(f"it sets the state of a {type(target).__name__}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed(module, name)
        if found is None:
            raise UnpickleRefused(f"it names the global {module}.{name}, which is not allowed")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnpickleRefused("it holds a persistent id, which is not allowed here")
        return self._persistent(pid)


def unpickle_allowed(
    data: bytes | bytearray | memoryview,
    allowed: Mapping[tuple[str, str], Any] | Callable[[str, str], Any],
    *,
    buildable: tuple[type, ...] = (),
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """The object pickled in ``data``, with every global looked up in ``allowed`` (a mapping of
    ``(module, name)`` to the object to use, or a function answering None for a refusal), the
    state set only of instances of ``buildable`` classes, and persistent ids answered by
    ``persistent_load`` (refused without one). Any refusal or malformed pickle raises
    ``UnpickleRefused`` saying why; nothing outside ``allowed`` ran."""
    look_up = allowed if callable(allowed) else lambda module, name: allowed.get((module, name))
    try:
        return _AllowlistUnpickler(data, look_up, persistent_load, buildable).load()
    except UnpickleRefused:
        raise
    except RecursionError:
        raise UnpickleRefused("it nests too deeply") from None
    except Exception as exc:  # noqa: BLE001 - a malformed pickle, whatever the unpickler says
        raise UnpickleRefused(f"it is not a readable pickle ({_reason(exc)})") from None


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
