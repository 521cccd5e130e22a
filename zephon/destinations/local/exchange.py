"""The uploader threads' collectives: a gloo group of their own, entered only once every rank
has arrived, so that an uploader that died on one rank fails the others within a poll, not at
the group's timeout (docs/tiers.md, "An uploader that dies").

A gloo collective waits for its peers in C++ and cannot be interrupted; a peer whose *process*
died closes its sockets and the wait fails, but a peer whose uploader *thread* died leaves them
open and the wait lasts the group's timeout (30 minutes). So before each collective every rank
sets ``<prefix>/<seq>/<rank>`` in the job's rendezvous store (the TCPStore every process group
has) and polls until every rank's key is there, checking ``<prefix>/dead`` on each poll: a
dying uploader sets that key with its reason, and every other rank's next poll raises
``UploaderDiedError``. The collective itself starts once every rank is there, so it never waits
long. Each rank deletes its own arrival key once the collective returned (every rank had seen
it by then): the store holds nothing between uploads but the death notice.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch.distributed as dist

from zephon.errors import ZephonError

__all__ = ["Exchange", "UploaderDiedError"]

#: how often, at most, a rank waiting for the others looks for them and for a death notice
POLL_S = 0.1
#: how long a rank waits for the others to arrive (a peer process gone without closing its
#: sockets, or one stuck for good); the process groups' own timeout
ARRIVAL_TIMEOUT_S = 1800.0


class UploaderDiedError(ZephonError):
    """The uploader thread of a rank stopped: no rank uploads any more in this job."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class Exchange:
    """Rank-ordered object collectives among the uploader threads of every rank."""

    def __init__(self, distributed: bool, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.poll_s = POLL_S
        self.arrival_timeout_s = ARRIVAL_TIMEOUT_S
        self._seq = 0
        # Every rank creates the group at the same point (the manager's constructor), so its
        # name, and with it the store prefix, is the same on every rank.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._store: Any = None
        self._prefix = ""
        if self.group is not None:
            self._store = dist.distributed_c10d._get_default_store()  # shared by every group
            self._prefix = f"zephon/uploader/{self.group.group_name}"

    @property
    def _dead_key(self) -> str:
        return f"{self._prefix}/dead"

    def all_gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        self._collective(lambda: dist.all_gather_object(out, value, group=self.group))
        return out

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (None elsewhere)."""
        if self.group is None:
            return [value]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._collective(lambda: dist.gather_object(value, out, dst=0, group=self.group))
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.group is None:
            return value
        box = [value]
        self._collective(lambda: dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def _collective(self, run: Any) -> None:
        self._seq += 1
        mine = f"{self._prefix}/{self._seq}/{self.rank}"
        self._store.set(mine, b"1")
        self._arrive([f"{self._prefix}/{self._seq}/{r}" for r in range(self.world_size)])
        # Every rank set its key of this collective, so every rank is past the previous one's
        # arrival: only now may its key go. (Deleted right after the collective, a fast rank's
        # key could vanish before a slow one, still polling, had seen it: a receiver of a
        # broadcast finishes as soon as its data came, and the slow rank waited forever.)
        if self._seq > 1:
            self._store.delete_key(f"{self._prefix}/{self._seq - 1}/{self.rank}")
        run()

    def _arrive(self, keys: list[str]) -> None:
        """Wait until every rank set its key; raise if an uploader died meanwhile."""
        deadline = time.monotonic() + self.arrival_timeout_s
        pause = 0.001  # peers usually arrive within milliseconds: look again soon, then less
        while not self._store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
                raise UploaderDiedError(
                    f"the uploaders of ranks {missing} did not reach the next upload step in "
                    f"{self.arrival_timeout_s:g} s; restart the job (its local checkpoints are "
                    "uploaded by the next start)"
                )
            time.sleep(pause)
            pause = min(pause * 2, self.poll_s)
        self.check_alive()

    def check_alive(self) -> None:
        """Raise ``UploaderDiedError`` if a rank's uploader left a death notice."""
        if self._store is None or not self._store.check([self._dead_key]):
            return
        said = self._store.get(self._dead_key).decode(errors="replace")
        rank_text, _, reason = said.partition(": ")
        rank = int(rank_text) if rank_text.isdigit() else None
        raise UploaderDiedError(
            f"the uploader of rank {rank_text} stopped ({reason}); no rank uploads any more: "
            "restart the job (its local checkpoints are uploaded by the next start)",
            rank=rank,
        )

    def announce_death(self, reason: str) -> None:
        """This rank's uploader stops: tell every other rank (the first notice stays)."""
        if self._store is None:
            return
        with contextlib.suppress(Exception):
            if not self._store.check([self._dead_key]):
                self._store.set(self._dead_key, f"{self.rank}: {reason}"[:1000].encode())

    def close(self) -> None:
        """Leave the group (a death notice stays: the prefix is this group's alone)."""
        if self.group is None:
            return
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)
        self.group = None
