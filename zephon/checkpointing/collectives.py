"""The few collectives the checkpoint manager needs, on its own process group.

The manager runs its collectives on a gloo group of its own so a background (async) save never
interleaves with the training loop's collectives on the default group. Without an initialised
``torch.distributed`` everything degrades to a single process.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import torch.distributed as dist

__all__ = ["Collectives"]


class Collectives:
    """Rank, world size, barrier, broadcast and gather over one process group."""

    def __init__(self, timeout: dt.timedelta = dt.timedelta(minutes=30)) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            # Every rank must create the groups, in the same order: the manager is constructed
            # on every rank at the same point of the program. ``group`` carries the manager's
            # own collectives; ``io_group`` torch DCP's, which run in a background thread
            # during an async save while the main thread may use ``group``.
            self.group = dist.new_group(backend="gloo", timeout=timeout)
            self.io_group = dist.new_group(backend="gloo", timeout=timeout)
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
        else:
            self.group = None
            self.io_group = None
            self.rank = 0
            self.world_size = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (in rank order); None on the others."""
        if not self.distributed:
            return [value]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, out, dst=0, group=self.group)
        return out

    def all_gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def destroy(self) -> None:
        if self.distributed:
            for group in (self.group, self.io_group):
                if group is not None:
                    dist.destroy_process_group(group)
            self.group = self.io_group = None
