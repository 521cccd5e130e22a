"""Errors of Zephon's torch Distributed Checkpoint layer.

DCP sends exceptions between ranks by pickling them (``gather_object``), so every class here
rebuilds from its message alone: extra data lives in attributes with defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from zephon.errors import ZephonError

__all__ = [
    "DCPError",
    "DistributedCheckpointError",
    "CoordinatorError",
    "MetadataEncodingError",
    "StateDictMismatchError",
    "StockCheckpointError",
    "UnsafeItemError",
    "WriterSetupError",
]


class DCPError(ZephonError):
    """Root of the errors raised by ``zephon.dcp``."""


class WriterSetupError(DCPError, ValueError):
    """A ``ZephonStorageWriter`` is used in a way that cannot produce a complete checkpoint:
    e.g. the coordinator holds a secondary writer, or ranks write different attempts."""


class MetadataEncodingError(DCPError, TypeError):
    """The DCP metadata holds a value Zephon cannot store as JSON (e.g. a custom planner's
    ``planner_data``); the message names the field."""


class StateDictMismatchError(DCPError, ValueError):
    """The state dict to load into does not match the checkpoint: keys it lacks, or tensors
    whose saved shape differs. ``missing`` and ``shape_mismatches`` name every such key."""

    def __init__(
        self,
        message: str,
        *,
        missing: Sequence[str] = (),
        shape_mismatches: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        url: str | None = None,
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        #: key -> (shape in the checkpoint, shape in the state dict)
        self.shape_mismatches = dict(shape_mismatches or {})
        self.url = url


class UnsafeItemError(DCPError, ValueError):
    """A checkpoint item that would make a load run code or change what kind of value lands in
    the state dict: a non-tensor item whose pickle the restricted unpickler refuses (it names
    something other than tensors, plain containers and numbers), or an item the metadata calls
    non-tensor where the state dict holds a tensor. Nothing of it was executed or loaded.
    ``key`` names the item, ``url`` the checkpoint."""

    def __init__(self, message: str, *, key: str = "", url: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.url = url


class StockCheckpointError(DCPError, ValueError):
    """A stock DCP checkpoint (torch's ``FileSystemWriter``) that ``zephon adopt`` refuses: a
    pickle naming a global outside the allowlist, a compressed or transformed item, a
    non-contiguous tensor view, a truncated blob. ``path`` names the file; nothing of it ran."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class DistributedCheckpointError(DCPError):
    """A DCP save or load failed on one or more ranks with an error that is not Zephon's own.

    ``failures`` maps each failing rank to its exception (as received from that rank); the
    message names every rank and its error in one line each.
    """

    def __init__(self, message: str, *, failures: Mapping[int, BaseException] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


class CoordinatorError(DCPError):
    """An error the coordinator raised during a DCP call whose class cannot be rebuilt on the
    other ranks (DCP sends errors between ranks pickled): e.g. a catalog refusal. Every rank
    raises this instead; ``kind`` names the original class, the message is the original's."""

    def __init__(self, message: str, *, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives DCP's trip between ranks (pickling), else a ``CoordinatorError``
    with its class name and message, caused by it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to rebuild means it cannot travel
        kind = type(exc).__name__
        out = CoordinatorError(f"{kind}: {exc}", kind=kind)
        out.__cause__ = exc
        return out
