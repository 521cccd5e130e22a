"""The few collectives the checkpoint manager needs, on its own process group.

The manager runs its collectives on a gloo group of its own so a background (async) save never
interleaves with the training loop's collectives on the default group. Without an initialised
``torch.distributed`` everything degrades to a single process.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from zephon.errors import ZephonError

T = TypeVar("T")

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

    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective: every rank says whether its part of ``what`` worked; if any failed, every
        rank raises (its own exception where it failed), instead of the others waiting forever
        in the next collective."""
        statuses = self.all_gather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [(rank, text) for rank, text in enumerate(statuses) if text is not None]
        if failed:
            rank, text = failed[0]
            others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
            raise ZephonError(f"rank {rank}{others} could not {what}: {text}")

    def from_main(self, compute: Callable[[], T], what: str) -> T:
        """Collective: ``compute()`` on rank 0, its result on every rank; if it raises, rank 0
        raises it and every other rank a ``ZephonError`` naming it."""
        outcome: tuple[str, Any] = ("ok", None)
        error: BaseException | None = None
        if self.is_main:
            try:
                outcome = ("ok", compute())
            except Exception as exc:
                error = exc
                outcome = ("error", f"{type(exc).__name__}: {exc}")
        outcome = self.broadcast(outcome)
        if error is not None:
            raise error
        if outcome[0] == "error":
            raise ZephonError(f"rank 0 could not {what}: {outcome[1]}")
        return outcome[1]

    def destroy(self) -> None:
        if self.distributed:
            for group in (self.group, self.io_group):
                if group is not None:
                    dist.destroy_process_group(group)
            self.group = self.io_group = None
