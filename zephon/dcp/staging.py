"""``ZephonStager``: staging for ``async_save`` into host buffers kept from one save to the next.

DCP's default stager allocates a fresh copy of the whole state on every save; on the CPU, most of
that time is the kernel handing out and zeroing new pages. Copying into buffers that already
exist takes a fraction of it, which is what the training loop waits for.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future, wait
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

__all__ = ["ZephonStager"]

_Path = tuple[Any, ...]


class ZephonStager(AsyncStager):
    """Stages a state dict for ``dcp.async_save``: every tensor is copied into a host buffer of
    its own (reused by the next save when its shape, dtype and path are unchanged), every other
    value is deep-copied, so later in-place updates never reach the checkpoint.

    Keep one per training job and pass it to ``zephon.dcp.async_save``, which waits for the
    previous save that used the buffers before staging into them again. Thread-safe for that use;
    call ``close()`` to free the buffers.
    """

    _synchronize_after_execute = False

    def __init__(self, *, reuse_buffers: bool = True) -> None:
        self.reuse_buffers = reuse_buffers
        self._buffers: dict[_Path, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._in_flight: Future | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` in host memory (DTensors stay DTensors over copied local
        shards)."""
        with self._lock:
            return self._copy(state_dict, ())

    def wait_idle(self) -> None:
        """Block until the save that last used this stager's buffers has finished (its outcome
        is reported by its own future, not here)."""
        previous = self._in_flight
        if previous is not None:
            wait([previous])

    def track(self, future: Future) -> None:
        """Record the save that now reads from the buffers."""
        self._in_flight = future

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        self.wait_idle()
        with self._lock:
            self._buffers.clear()

    # -- internals -----------------------------------------------------------------------------

    def _copy(self, value: Any, path: _Path) -> Any:
        if isinstance(value, DTensor):
            local = self._tensor(value.to_local(), path)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, dict):
            return {k: self._copy(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._copy(v, (*path, i)) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, path: _Path) -> torch.Tensor:
        source = tensor.detach()
        buffer = self._buffers.get(path) if self.reuse_buffers else None
        if (
            buffer is None
            or buffer.shape != source.shape
            or buffer.dtype != source.dtype
            or buffer.layout != source.layout
        ):
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu")
            if self.reuse_buffers:
                self._buffers[path] = buffer
        buffer.copy_(source)
        return buffer
