"""Assembling one state dict from every rank's progress over torch.distributed.

The transport of ``Pipeline.checkpoint()`` selected by ``aggregate_store="torch://"`` (and by
default when torch.distributed is initialised and no ``aggregate_dir`` is given), or by
``aggregate_store="torch://HOST:PORT"`` (a TCPStore at that address, no process group): no
shared directory, and every rank gets the merged state. torch is imported only when a pipeline uses
it, so ``zephon.pipeline`` stays importable without torch; :func:`distributed_ready` looks for
an initialised process group without importing anything.

One checkpoint, on every rank of the group:

1. **Arrival, through the group's rendezvous store** (the TCPStore every process group has,
   whatever its backend). A rank sets ``<prefix>/rank/<r>`` and adds 1 to ``<prefix>/count``;
   the rank whose ``add`` returns ``world_size`` sets ``<prefix>/complete``, which every rank
   waits for, at most ``aggregate_timeout_s``. On timeout the rank reads the per-rank keys, so
   ``AggregationTimeoutError`` names the ranks that never arrived (a collective that times out
   could only say that *something* did not), and sets ``<prefix>/abort`` so that a rank arriving
   after that fails at once instead of entering a collective nobody else will join.
2. **Exchange, by a collective on a CPU group**: the parts, JSON bytes, go through two
   ``all_gather`` calls (lengths, then padded bytes); JSON rather than ``all_gather_object``
   because nothing here needs pickle. Every rank merges the same parts in rank order with
   ``merge_parts``, the function the storage transport uses, so every rank gets the same state
   and it is byte for byte the storage transport's.
3. **Cleanup**: once a rank is past the collective every rank has passed its wait, so each
   deletes its own arrival key and rank 0 the counter and ``complete``: the store holds nothing
   between checkpoints.

**Through a TCPStore alone** (``torch://HOST:PORT``, for jobs without a process group): the
same three steps with the store as the only channel. Arrival sets ``<prefix>/rank/<r>`` to the
rank's part itself (JSON bytes), so step 2 is each rank reading every part from the store; each
rank then adds 1 to ``<prefix>/read``, and the rank whose ``add`` returns ``world_size`` deletes
the parts, the counters and ``complete`` (nobody reads them any more). Rank and world size are
the pipeline's own ``global_rank`` and ``world_size``. The store's server: the pipeline's rank 0
hosts it at its first checkpoint unless something already listens on PORT (torchrun's store on
``MASTER_PORT``, a server the launcher started), and then, like every other rank, connects as a
client, waiting up to ``aggregate_timeout_s`` for the server. So HOST must be rank 0's machine
when nobody else serves the address (as ``MASTER_ADDR`` is under torchrun). One connection per
address per process is kept for the process's life, so a server hosted by rank 0 outlives its
pipelines and later pipelines (a restore, another run_id) reuse it; each pipeline talks through
its own clone of that connection (a store object serialises its calls, so a shared one would
let one pipeline's wait stall another's arrival).

``<prefix>`` is ``zephon/pipeline/<run_id or a digest of the pipeline's configuration>/<ranks of
the group>/<epoch>-<seq>`` (the same key the storage transport uses), so successive checkpoints
and pipelines with different run_ids never share a key.

The group: ``aggregate_group`` if given (it must be able to move CPU tensors: gloo, or a
``"cpu:gloo,cuda:nccl"`` group), else the default group. A default group without a CPU backend
(plain NCCL) gets a gloo side group over the same ranks, created once per process at the first
checkpoint, after the arrival step (``new_group`` is collective, and only then is every rank
known to be there).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import sys
import threading
from typing import Any

from zephon.errors import ConfigError
from zephon.pipeline.errors import AggregationError, AggregationTimeoutError
from zephon.pipeline.state import Identity, merge_parts

__all__ = ["TORCH_STORE", "TorchAggregator", "distributed_ready", "store_address"]

TORCH_STORE = "torch://"
_PREFIX = "zephon/pipeline"
_ADDRESS = re.compile(r"torch://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})")
# (default group, its gloo side group): NCCL-only default groups cannot move CPU tensors.
_side_group: tuple[Any, Any] | None = None
# One TCPStore per "torch://HOST:PORT" per process, kept for its life (a server hosted here too).
_stores: dict[tuple[str, int], Any] = {}
_kept: list[Any] = []
_stores_lock = threading.Lock()


def store_address(value: str) -> tuple[str, int] | None:
    """``aggregate_store`` checked: ``None`` for ``"torch://"`` (the process group's store),
    ``(host, port)`` for ``"torch://HOST:PORT"``; anything else is a one-line ``ConfigError``."""
    if value == TORCH_STORE:
        return None
    match = _ADDRESS.fullmatch(value) if isinstance(value, str) else None
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ConfigError(
            f"aggregate_store must be {TORCH_STORE!r} (the process group's store) or "
            f"'torch://HOST:PORT' (a TCPStore at that address, port 1-65535), got {value!r}; "
            "for a shared directory give aggregate_dir=URL"
        )
    return match["host"].strip("[]"), int(match["port"])


def distributed_ready() -> bool:
    """Whether torch.distributed has a default process group, without importing torch: a
    process that never imported ``torch.distributed`` cannot have initialised it."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _cpu_capable(dist: Any, group: Any) -> bool:
    config = str(dist.get_backend_config(group))  # "cpu:gloo,cuda:nccl", or a backend name
    entries = [entry.strip() for entry in config.split(",")]
    if any(":" in entry for entry in entries):
        return any(entry.split(":", 1)[0] == "cpu" for entry in entries)
    return config in {"gloo", "mpi"}


class TorchAggregator:
    """The torch.distributed protocol for one pipeline process (one rank); see the module doc.

    Constructed when the pipeline starts (first iteration or ``checkpoint()``), so a wrong
    topology is refused before training, not at the first checkpoint. With an ``address``
    there is no group to check against: rank and world size are the pipeline's, and the store
    is connected to at the first checkpoint (a rank's arrival there is already a wait).
    """

    def __init__(
        self,
        *,
        run_id: str | None,
        identity: Identity,
        world_size: int,
        rank: int,
        timeout_s: float,
        group: Any = None,
        address: tuple[str, int] | None = None,
    ) -> None:
        self.run_id = run_id
        self.world_size = world_size
        self.rank = rank
        self.timeout_s = timeout_s
        self._group = group
        self._address = address
        namespace = f"{_PREFIX}/{run_id or _digest(identity.header())}"
        if address is not None:  # PipelineOptions refuses an address with a group
            self._store = None  # connected at the first checkpoint: see _connected()
            self._namespace = f"{namespace}/world"
            return
        if not distributed_ready():
            raise ConfigError(
                f"aggregate_store={TORCH_STORE!r} needs torch.distributed initialised before the "
                "pipeline starts: call torch.distributed.init_process_group() first, or give "
                "aggregate_dir=<fsspec URL shared by all ranks> instead"
            )
        import torch.distributed as dist

        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ConfigError(
                "aggregate_group must be a torch.distributed ProcessGroup (e.g. "
                f"torch.distributed.new_group(backend='gloo')), got {type(group).__name__}"
            )
        which = "aggregate_group" if group is not None else "the default process group"
        size, own = dist.get_world_size(group), dist.get_rank(group)
        if own < 0:
            raise ConfigError(f"this process is not a member of {which}: pass a group it is in")
        if size != world_size or own != rank:
            raise ConfigError(
                f"{which} has {size} ranks and this process is its rank {own}, but the pipeline "
                f"says world_size={world_size}, global_rank={rank}: the pipeline's world_size "
                "and global_rank must be the group's size and rank (dist.get_world_size(), "
                "dist.get_rank()); if only some ranks hold pipelines, pass their group as "
                "aggregate_group"
            )
        if group is not None and not _cpu_capable(dist, group):
            raise ConfigError(
                f"aggregate_group uses backend {dist.get_backend_config(group)!r}, which cannot "
                "move CPU tensors: pass a gloo group, e.g. "
                "torch.distributed.new_group(ranks, backend='gloo')"
            )
        self._dist = dist
        # A clone is this aggregator's own connection to the group's store: a store object
        # serialises its calls, so a wait here would stall any other thread's use of it.
        self._store = _own_connection(dist.distributed_c10d._get_default_store())
        members = dist.get_process_group_ranks(group) if group is not None else None
        self._namespace = f"{namespace}/{'world' if members is None else _digest(members)}"

    @property
    def url(self) -> str:
        """``torch://``, or ``torch://HOST:PORT`` with an address: what errors name."""
        if self._address is None:
            return TORCH_STORE
        host, port = self._address
        return f"{TORCH_STORE}{f'[{host}]' if ':' in host else host}:{port}"

    def checkpoint(self, key: str, part: dict[str, Any], identity: Identity) -> dict[str, Any]:
        """Every rank of the group: exchange parts for ``key`` and return the merged state.

        Raises ``AggregationTimeoutError`` naming the ranks that did not arrive within
        ``aggregate_timeout_s``, ``AggregationError`` when the parts cannot be merged (ranks
        that did not checkpoint at the same step, or built different pipelines).
        """
        prefix = f"{self._namespace}/{key}"
        data = json.dumps(part, separators=(",", ":")).encode()
        if self._address is None:
            self._arrive(prefix, key, b"1")
            blobs = self._all_gather_bytes(data)
            self._store.delete_key(f"{prefix}/rank/{self.rank}")
            if self.rank == 0:
                self._store.delete_key(f"{prefix}/count")
                self._store.delete_key(f"{prefix}/complete")
        else:
            self._connected(key)
            self._arrive(prefix, key, data)
            blobs = self._read_parts(prefix)
        parts = [json.loads(blob) for blob in blobs]
        counts = {p.get("rank"): p.get("delivered") for p in parts}
        if len(set(counts.values())) > 1:
            raise AggregationError(
                f"pipeline checkpoint {key!r}: ranks delivered different numbers of batches "
                f"since the run (or its restore) began ({counts}): every rank must call "
                "checkpoint() after the same step",
                run_id=self.run_id,
                url=self.url,
            )
        return merge_parts(parts, identity, run_id=self.run_id or "", url=self.url)

    def _arrive(self, prefix: str, key: str, value: bytes) -> None:
        store = self._store
        store.set(f"{prefix}/rank/{self.rank}", value)
        self._check_abort(prefix, key)
        if store.add(f"{prefix}/count", 1) == self.world_size:
            store.set(f"{prefix}/complete", b"1")
        try:
            store.wait([f"{prefix}/complete"], dt.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # DistStoreError: the wait timed out
            missing = [r for r in range(self.world_size) if not store.check([f"{prefix}/rank/{r}"])]
            if not missing:  # the last rank arrived just as the wait gave up
                return self._check_abort(prefix, key)
            store.set(f"{prefix}/abort", json.dumps(missing).encode())
            said = f"ranks {missing} did not arrive within {self.timeout_s:g} s"
            raise self._timeout(key, missing, said) from exc
        self._check_abort(prefix, key)

    def _check_abort(self, prefix: str, key: str) -> None:
        store = self._store
        if store.check([f"{prefix}/abort"]):
            missing = json.loads(store.get(f"{prefix}/abort"))
            said = (
                f"rank {self.rank} arrived after the others had waited {self.timeout_s:g} s "
                f"for ranks {missing} and given up"
            )
            raise self._timeout(key, missing, said)

    def _timeout(self, key: str, missing: list[int], said: str) -> AggregationTimeoutError:
        run = f" of run {self.run_id!r}" if self.run_id else ""
        return AggregationTimeoutError(
            f"pipeline checkpoint {key!r}{run} over {self._channel()} (rank {self.rank}): "
            f"{said}; every rank in world_size={self.world_size} "
            "must call checkpoint() at the same step (raise aggregate_timeout_s if they are slow)",
            missing_ranks=missing,
            timeout_s=self.timeout_s,
            run_id=self.run_id,
            url=self.url,
        )

    def _connected(self, key: str) -> None:
        """Connect to the address's TCPStore once per process; rank 0 hosts it if nobody does."""
        if self._store is not None:
            return
        import torch.distributed as dist

        with _stores_lock:
            store = _stores.get(self._address)
        if store is None:
            # Connected outside the lock: a client may wait for a server that rank 0, in this
            # very process (threads), is about to host.
            store = self._open_store(dist, key)
            with _stores_lock:
                _kept.append(store)  # a server hosted here must outlive any pipeline
                store = _stores.setdefault(self._address, store)
        self._store = _own_connection(store)

    def _open_store(self, dist: Any, key: str) -> Any:
        host, port = self._address
        timeout = dt.timedelta(seconds=self.timeout_s)
        if self.rank == 0:
            try:
                return dist.TCPStore(
                    host, port, is_master=True, wait_for_workers=False, timeout=timeout
                )
            except dist.DistNetworkError:
                pass  # PORT is taken: a server is already there (torchrun's, the launcher's)
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except dist.DistError as exc:
            said = (
                f"nobody served the TCPStore at {self.url} within {self.timeout_s:g} s (rank 0 "
                "hosts it unless a server already listens there: HOST must be rank 0's machine)"
            )
            raise self._timeout(key, [0], said) from exc

    def _read_parts(self, prefix: str) -> list[bytes]:
        """Every rank's part from the store; the last rank to read them deletes the keys."""
        store = self._store
        names = [f"{prefix}/rank/{r}" for r in range(self.world_size)]
        blobs = [bytes(blob) for blob in store.multi_get(names)]
        # Past the wait every rank's part is in hand, so cleanup can only fail if the server
        # went away (rank 0 hosting it exited first), and then the keys went with it.
        try:
            if store.add(f"{prefix}/read", 1) == self.world_size:
                for name in [*names, f"{prefix}/count", f"{prefix}/complete", f"{prefix}/read"]:
                    store.delete_key(name)
        except RuntimeError:
            pass
        return blobs

    def _channel(self) -> str:
        return "torch.distributed" if self._address is None else f"the TCPStore at {self.url}"

    def _collective_group(self) -> Any:
        global _side_group
        dist = self._dist
        if self._group is not None or _cpu_capable(dist, None):
            return self._group
        world = dist.group.WORLD
        if _side_group is None or _side_group[0] is not world:
            _side_group = (world, dist.new_group(backend="gloo"))
        return _side_group[1]

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        import torch

        dist, group = self._dist, self._collective_group()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
        lengths = [int(s.item()) for s in sizes]
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=group)
        return [bytes(t[:n].tolist()) for t, n in zip(out, lengths, strict=True)]


def _own_connection(store: Any) -> Any:
    """A connection of this aggregator's own to ``store``'s server (``Store.clone()``).

    A store object serialises its calls: one thread's ``wait`` holds it until the key appears
    or the wait times out, so two pipelines of one process sharing an object (ranks as threads,
    or a pipeline beside an async checkpoint thread) could wait on each other until the timeout.
    """
    try:
        return store.clone()
    except (AttributeError, RuntimeError):  # a store that cannot be cloned is used as it is
        return store


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
