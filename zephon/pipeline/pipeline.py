"""``Pipeline``: the builder, iteration over the owned lanes, ``checkpoint()`` and ``restore()``.

Data-parallel group ``g`` of ``dp_degree`` owns the lanes ``l`` with ``l % dp_degree == g`` and
reads one microbatch from each owned lane in turn (the lane with the fewest batches delivered,
ties to the lowest id). Every lane's stream is a pure function of the configuration, and the
turn order depends only on batch counts, so the output is the same for any prefetch depth or
map parallelism: those only change *when* work happens.

Progress is counted when a batch is handed to the caller, never when it is prepared, so
``checkpoint()`` ignores prefetched work.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from zephon.errors import ConfigError
from zephon.pipeline.aggregate import Aggregator, aggregation_key
from zephon.pipeline.aggregate_torch import TorchAggregator, distributed_ready, store_address
from zephon.pipeline.iteration import Iteration
from zephon.pipeline.lanes import LanePlan, LaneProgress, owned_lanes
from zephon.pipeline.operators import (
    PREFETCH_WORKERS,
    BatchSpec,
    MapOp,
    Operator,
    PackOp,
    PrefetchSpec,
    ShuffleOp,
    check_positive_int,
    reorders,
    signature,
)
from zephon.pipeline.records import Batch
from zephon.pipeline.state import (
    Identity,
    build_lanes,
    build_part,
    build_state,
    parse_state,
)
from zephon.pipeline.work_source import StaticMixtureWorkSource

__all__ = ["Pipeline", "PipelineOptions"]

_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
DEFAULT_FLUSH_EVERY_K_CHUNKS = 8


@dataclass(kw_only=True, slots=True, frozen=True)
class PipelineOptions:
    """Topology and checkpointing settings; see ``Pipeline.options``."""

    world_size: int = 1
    global_rank: int = 0
    dp_degree: int = 1
    dp_group_id: int = 0
    canonical_replicas: int | None = None
    aggregate_dir: str | None = None
    aggregate_store: str | None = None
    aggregate_group: Any = None
    run_id: str | None = None
    aggregate_timeout_s: float = 300.0
    flush_every_k_chunks: int | None = None
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_positive_int("world_size", self.world_size)
        check_positive_int("global_rank", self.global_rank, minimum=0)
        check_positive_int("dp_degree", self.dp_degree)
        check_positive_int("dp_group_id", self.dp_group_id, minimum=0)
        if self.global_rank >= self.world_size:
            raise ConfigError(
                f"global_rank must be in range(world_size={self.world_size}), "
                f"got {self.global_rank}"
            )
        if self.dp_group_id >= self.dp_degree:
            raise ConfigError(
                f"dp_group_id must be in range(dp_degree={self.dp_degree}), got {self.dp_group_id}"
            )
        if self.dp_degree > self.world_size:
            raise ConfigError(
                f"dp_degree={self.dp_degree} needs at least as many ranks, got "
                f"world_size={self.world_size}: every data-parallel group needs a rank whose "
                "progress goes into the checkpoint"
            )
        if self.canonical_replicas is not None:
            check_positive_int("canonical_replicas", self.canonical_replicas)
            if self.canonical_replicas % self.dp_degree:
                raise ConfigError(
                    f"canonical_replicas={self.canonical_replicas} must be divisible by "
                    f"dp_degree={self.dp_degree} so every data-parallel group owns the same "
                    "number of lanes"
                )
        if self.flush_every_k_chunks is not None:
            check_positive_int("flush_every_k_chunks", self.flush_every_k_chunks, minimum=0)
        timeout = self.aggregate_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"aggregate_timeout_s must be a number > 0, got {timeout!r}")
        address = None if self.aggregate_store is None else store_address(self.aggregate_store)
        if address is not None and self.aggregate_group is not None:
            raise ConfigError(
                f"aggregate_group needs aggregate_store='torch://' (the group's own store), not "
                f"{self.aggregate_store!r}: give a process group or an address, not both"
            )
        if self.aggregate_dir is not None and (
            self.aggregate_store is not None or self.aggregate_group is not None
        ):
            given = "aggregate_store" if self.aggregate_store is not None else "aggregate_group"
            raise ConfigError(
                f"give either aggregate_dir (a shared directory) or {given} (torch.distributed), "
                "not both"
            )
        if self.world_size > 1 and self.aggregate_dir is not None:
            if not self.aggregate_dir or not isinstance(self.aggregate_dir, str):
                raise ConfigError(
                    "aggregate_dir must be an fsspec URL shared by all ranks, e.g. "
                    f"s3://bucket/agg, got {self.aggregate_dir!r}"
                )
            if self.run_id is None:
                raise ConfigError(
                    f"run_id is required with aggregate_dir and world_size={self.world_size}: "
                    "1-128 characters of [A-Za-z0-9._-], the same on every rank"
                )
        if (
            self.world_size > 1
            and self.run_id is not None
            and (not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id))
        ):
            raise ConfigError(
                "run_id must be 1-128 characters of [A-Za-z0-9._-], the same on every "
                f"rank; got {self.run_id!r}"
            )


class Pipeline:
    """A data pipeline over a work source; iterate it to get ``Batch`` objects.

    Builder methods mutate the pipeline and return it, so calls chain. The configuration is
    frozen by the first iteration, ``checkpoint()`` or ``restore()``.
    """

    def __init__(self, work_source: StaticMixtureWorkSource) -> None:
        if not isinstance(work_source, StaticMixtureWorkSource):
            raise ConfigError(
                "Pipeline needs a work source such as zephon.StaticMixtureWorkSource(...), got "
                f"{type(work_source).__name__}"
            )
        self._source = work_source
        self._ops: list[Operator] = []
        self._batch: BatchSpec | None = None
        self._prefetch: PrefetchSpec | None = None
        self._options = PipelineOptions()
        self._resolved: tuple[LanePlan, Identity, list[int]] | None = None
        self._progress: dict[int, LaneProgress] = {}
        self._epoch = "fresh"
        self._seq = 0
        self._delivered = 0  # batches handed out since the epoch (fresh start or restore) began
        self._active: Iteration | None = None
        self._aggregator: Aggregator | TorchAggregator | None = None
        self._lock = threading.Lock()

    # -- builder ---------------------------------------------------------------------------------

    def _mutable(self, what: str) -> None:
        if self._resolved is not None:
            raise ConfigError(
                f"cannot call {what}() after the pipeline started (iteration, checkpoint() or "
                "restore()); build a new Pipeline instead"
            )

    def _before_batch(self, what: str) -> None:
        self._mutable(what)
        if self._batch is not None:
            raise ConfigError(f"{what}() must come before batch(): batch is the last operator")

    def map_transform(self, fn: Callable[[Any], Any], drop_none: bool = True) -> Pipeline:
        """Apply ``fn`` to every record; with ``drop_none``, records it maps to ``None`` vanish.

        ``fn`` must be deterministic (the same output for the same input, every time, on every
        machine): a restore re-runs it on re-read records and trusts the result to match.
        """
        self._before_batch("map_transform")
        if not callable(fn):
            raise ConfigError(f"map_transform fn must be callable, got {fn!r}")
        if not isinstance(drop_none, bool):
            raise ConfigError(f"map_transform drop_none must be True or False, got {drop_none!r}")
        self._ops.append(MapOp(fn, drop_none))
        return self

    def shuffle(self, buffer_size: int, seed: int = 0) -> Pipeline:
        """Shuffle records within each flush window, moving each by < ``buffer_size`` places."""
        self._before_batch("shuffle")
        check_positive_int("shuffle buffer_size", buffer_size)
        check_positive_int("shuffle seed", seed, minimum=0)
        self._ops.append(ShuffleOp(buffer_size, seed))
        return self

    def pack_sequences(
        self,
        max_length: int,
        *,
        key: Callable[[Any], Sequence[Any]] | None = None,
        max_open_bins: int = 64,
        overflow: str = "truncate",
    ) -> Pipeline:
        """Greedy first-fit packing of token sequences into bins of ``max_length`` tokens.

        Records must be token lists, dicts with ``"tokens"``, or anything ``key`` maps to a
        token list. Each packed record is ``{"tokens": [...], "segment_lengths": [...]}``. At
        most ``max_open_bins`` bins are open at once (the oldest is emitted to open another);
        all bins close at every flush. ``overflow``: ``"truncate"`` cuts a sequence longer than
        ``max_length``, ``"error"`` refuses it.
        """
        self._before_batch("pack_sequences")
        check_positive_int("pack_sequences max_length", max_length)
        check_positive_int("pack_sequences max_open_bins", max_open_bins)
        if overflow not in {"truncate", "error"}:
            raise ConfigError(
                f"pack_sequences overflow must be 'truncate' or 'error', got {overflow!r}"
            )
        if key is not None and not callable(key):
            raise ConfigError(f"pack_sequences key must be callable or None, got {key!r}")
        self._ops.append(PackOp(max_length, key, max_open_bins, overflow))
        return self

    def batch(self, microbatch_size: int, drop_last: bool = True) -> Pipeline:
        """Group each lane's records into microbatches of ``microbatch_size``.

        Batches run across flush windows, so only the very end of a lane's curriculum can leave
        fewer than ``microbatch_size`` records: ``drop_last=True`` never delivers them (and the
        state never counts them; a restore drops the same remainder), ``drop_last=False``
        delivers them as a final short batch.
        """
        self._mutable("batch")
        if self._batch is not None:
            raise ConfigError("batch() was already called; a pipeline has one batch operator")
        check_positive_int("microbatch_size", microbatch_size)
        if not isinstance(drop_last, bool):
            raise ConfigError(f"batch drop_last must be True or False, got {drop_last!r}")
        self._batch = BatchSpec(microbatch_size, drop_last)
        return self

    def prefetch(
        self, buffer_size: int, parallelism: int = 1, *, workers: str = "processes"
    ) -> Pipeline:
        """Prepare up to ``buffer_size`` batches ahead in a background thread; with
        ``parallelism > 1`` map functions run in that many worker processes (``workers=
        "threads"``: threads, for maps that wait on I/O or release the GIL). A map function a
        new process cannot load (a lambda) runs on threads, with a warning. Output is unchanged.
        """
        self._mutable("prefetch")
        check_positive_int("prefetch buffer_size", buffer_size)
        check_positive_int("prefetch parallelism", parallelism)
        if workers not in PREFETCH_WORKERS:
            raise ConfigError(f"prefetch workers must be 'processes' or 'threads', got {workers!r}")
        self._prefetch = PrefetchSpec(buffer_size, parallelism, workers)
        return self

    def options(
        self,
        *,
        world_size: int | None = None,
        global_rank: int | None = None,
        dp_degree: int | None = None,
        dp_group_id: int | None = None,
        canonical_replicas: int | None = None,
        aggregate_dir: str | None = None,
        aggregate_store: str | None = None,
        aggregate_group: Any = None,
        run_id: str | None = None,
        aggregate_timeout_s: float | None = None,
        flush_every_k_chunks: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> Pipeline:
        """Set topology and checkpointing options; arguments left ``None`` keep their value.

        ``canonical_replicas`` (default: ``dp_degree``) is the number of lanes and must stay
        fixed for the life of a run. ``world_size``/``global_rank`` count every process that
        holds a pipeline; ``dp_degree``/``dp_group_id`` say which data-parallel group this
        one belongs to. With ``world_size > 1`` ``checkpoint()`` assembles every rank's
        progress through one of two transports: ``aggregate_store="torch://"`` over
        torch.distributed (the default group, or ``aggregate_group``; the default when
        torch.distributed is initialised and no ``aggregate_dir`` is given), or
        ``aggregate_store="torch://HOST:PORT"`` through a TCPStore at that address with no
        process group (rank 0 hosts it unless a server already listens there), or
        ``aggregate_dir``, an fsspec URL shared by all ranks (with ``storage_options``), which
        also needs ``run_id``. ``flush_every_k_chunks`` defaults to 8 when the chain shuffles or
        packs, else 0 (flush at every chunk).
        """
        self._mutable("options")
        given = {
            k: v
            for k, v in {
                "world_size": world_size,
                "global_rank": global_rank,
                "dp_degree": dp_degree,
                "dp_group_id": dp_group_id,
                "canonical_replicas": canonical_replicas,
                "aggregate_dir": aggregate_dir,
                "aggregate_store": aggregate_store,
                "aggregate_group": aggregate_group,
                "run_id": run_id,
                "aggregate_timeout_s": aggregate_timeout_s,
                "flush_every_k_chunks": flush_every_k_chunks,
                "storage_options": storage_options,
            }.items()
            if v is not None
        }
        self._options = replace(self._options, **given)
        return self

    # -- resolution ------------------------------------------------------------------------------

    def _resolve(self) -> tuple[LanePlan, Identity, list[int]]:
        if self._resolved is not None:
            return self._resolved
        opts = self._options
        if self._batch is None:
            raise ConfigError(
                "the pipeline has no batch operator: call .batch(microbatch_size) before "
                "iterating, checkpointing or restoring"
            )
        lanes = opts.canonical_replicas or opts.dp_degree
        if lanes % opts.dp_degree:
            raise ConfigError(
                f"canonical_replicas={lanes} must be divisible by dp_degree={opts.dp_degree}"
            )
        flush = opts.flush_every_k_chunks
        if flush is None:
            flush = DEFAULT_FLUSH_EVERY_K_CHUNKS if reorders(self._ops) else 0
        elif flush == 0 and reorders(self._ops):
            raise ConfigError(
                "flush_every_k_chunks=0 is not allowed when the pipeline re-orders records "
                "(shuffle or pack_sequences): they must flush at chunk boundaries for restores "
                "to be exact; use an integer >= 1 (default 8)"
            )
        plan = LanePlan(self._source, tuple(self._ops), lanes, max(flush, 1))
        identity = Identity(lanes, flush, self._source.fingerprint(), signature(self._ops))
        owned = owned_lanes(lanes, opts.dp_degree, opts.dp_group_id)
        self._progress = {lane: LaneProgress() for lane in range(lanes)}
        self._resolved = (plan, identity, owned)
        return self._resolved

    @property
    def owned_lanes(self) -> list[int]:
        """The lanes this pipeline's data-parallel group reads."""
        return list(self._resolve()[2])

    @property
    def flush_every_k_chunks(self) -> int:
        """The effective flush interval (after applying the default)."""
        return self._resolve()[1].flush_every_k_chunks

    # -- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        """Start iterating from the delivered progress (the restored state, if any).

        Starting a new iteration ends the previous one: its prefetched batches are discarded,
        and since they were never delivered the new iteration produces them again.
        """
        plan, _identity, owned = self._resolve()
        self._transport()  # a distributed misconfiguration fails now, not at the checkpoint
        with self._lock:
            self._close_active()
            run = Iteration(self, plan, owned, dict(self._progress))
            self._active = run
        return run

    def _deliver(self, lane: int, progress: LaneProgress) -> None:
        self._progress[lane] = progress
        self._delivered += 1

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def close(self) -> None:
        """Stop background prefetching; the pipeline can be iterated again afterwards."""
        with self._lock:
            self._close_active()

    # -- checkpoint / restore --------------------------------------------------------------------

    def _transport(self) -> Aggregator | TorchAggregator | None:
        """The aggregation transport, chosen when the pipeline starts (``None`` alone)."""
        opts = self._options
        if opts.world_size == 1 or self._aggregator is not None:
            return self._aggregator
        if opts.aggregate_dir is not None:
            self._aggregator = Aggregator(
                opts.aggregate_dir,
                opts.storage_options,
                opts.run_id,
                world_size=opts.world_size,
                rank=opts.global_rank,
                timeout_s=opts.aggregate_timeout_s,
            )
            return self._aggregator
        chosen = opts.aggregate_store is not None or opts.aggregate_group is not None
        if not chosen and not distributed_ready():
            raise ConfigError(
                f"world_size={opts.world_size} needs a way to assemble checkpoints: initialise "
                "torch.distributed before the pipeline starts (aggregate_store='torch://' is then "
                "the default) or give aggregate_dir=<fsspec URL shared by all ranks> and run_id"
            )
        self._aggregator = TorchAggregator(
            run_id=opts.run_id,
            identity=self._resolve()[1],
            world_size=opts.world_size,
            rank=opts.global_rank,
            timeout_s=opts.aggregate_timeout_s,
            group=opts.aggregate_group,
            address=store_address(opts.aggregate_store or "torch://"),
        )
        return self._aggregator

    def checkpoint(self) -> dict[str, Any]:
        """Progress delivered so far, as a small JSON-serialisable dict: the state to save.

        With ``world_size > 1`` every rank must call this at the same step; each contributes
        its lanes' progress and every rank returns the same merged state (byte for byte the
        same with either transport), so ``restore(checkpoint())`` works on every rank.
        ``AggregationTimeoutError`` names the ranks that did not arrive within
        ``aggregate_timeout_s``.
        """
        plan, identity, owned = self._resolve()
        opts = self._options
        lanes = build_lanes(plan, self._progress, owned)
        transport = self._transport()
        if transport is None:
            return build_state(identity, lanes)
        key = aggregation_key(self._epoch, self._seq)
        self._seq += 1
        part = build_part(
            identity,
            lanes,
            run_id=opts.run_id,
            key=key,
            rank=opts.global_rank,
            world_size=opts.world_size,
            dp_degree=opts.dp_degree,
            dp_group_id=opts.dp_group_id,
            delivered=self._delivered,
        )
        return transport.checkpoint(key, part, identity)

    def restore(self, state: dict[str, Any]) -> None:
        """Validate ``state`` now and resume from it when iteration next starts.

        Raises ``PipelineStateError`` naming the field for a wrong version, a malformed dict,
        or a state of a different configuration (``canonical_replicas``, flush interval,
        curriculum, operator chain). ``dp_degree`` may differ from the saving run: lanes are
        simply re-assigned. An iteration in progress ends; iterate the pipeline again.
        """
        _plan, identity, _owned = self._resolve()
        progress = parse_state(state, identity)
        digest = hashlib.sha256(
            json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()[:16]
        with self._lock:
            self._close_active()
            self._progress = progress
            self._epoch = digest
            self._seq = 0
            self._delivered = 0

    def __repr__(self) -> str:
        ops = signature(self._ops) or "-"
        return f"Pipeline({self._source!r}, ops={ops}, batch={self._batch})"
