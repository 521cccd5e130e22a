"""The pipeline's state dict: its schema, how it is built, validated, and merged across ranks.

A state dict is small, JSON-serialisable and describes per-lane *progress*, never operator
internals::

    {
      "format": "zephon.pipeline", "version": 1,
      "canonical_replicas": 2, "flush_every_k_chunks": 8,
      "work_source": "5f0c2a9e1b7d4e33", "operators": "map(drop_none=True)|shuffle(1024,seed=0)",
      "lanes": [
        {"lane": 0, "flushed_chunks": 8, "in_flight_chunks": 3, "delivered_since_flush": 4160,
         "batches": 386},
        {"lane": 1, ...}
      ]
    }

Per lane: ``flushed_chunks`` chunks lie before the current flush window and were fully
delivered; ``in_flight_chunks`` of the window have records delivered (they are what a restore
re-reads); ``delivered_since_flush`` entries of the window's order were consumed (records a map
dropped among them included); ``batches`` microbatches were delivered from the lane in total.
``work_source`` and ``operators`` identify the curriculum and the chain, so a restore into a
different configuration is refused instead of silently shifting data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zephon.pipeline.errors import AggregationError, PipelineStateError
from zephon.pipeline.lanes import LanePlan, LaneProgress

__all__ = [
    "STATE_FORMAT",
    "STATE_VERSION",
    "PART_FORMAT",
    "Identity",
    "build_lanes",
    "build_part",
    "build_state",
    "merge_parts",
    "parse_state",
]

STATE_FORMAT = "zephon.pipeline"
PART_FORMAT = "zephon.pipeline.part"
STATE_VERSION = 1
_LANE_FIELDS = ("lane", "flushed_chunks", "in_flight_chunks", "delivered_since_flush", "batches")


@dataclass(frozen=True, slots=True)
class Identity:
    """The configuration a state dict must match to be restored."""

    canonical_replicas: int
    flush_every_k_chunks: int
    work_source: str
    operators: str

    def header(self) -> dict[str, Any]:
        return {
            "canonical_replicas": self.canonical_replicas,
            "flush_every_k_chunks": self.flush_every_k_chunks,
            "work_source": self.work_source,
            "operators": self.operators,
        }


def lane_entry(plan: LanePlan, lane: int, progress: LaneProgress) -> dict[str, int]:
    in_flight = 0
    if progress.cursor:
        in_flight = len(plan.window_chunk_list(lane, progress.window))
    return {
        "lane": lane,
        "flushed_chunks": progress.window * plan.window_chunks,
        "in_flight_chunks": in_flight,
        "delivered_since_flush": progress.cursor,
        "batches": progress.batches,
    }


def build_lanes(
    plan: LanePlan, progress: Mapping[int, LaneProgress], lanes: Sequence[int]
) -> list[dict[str, int]]:
    return [lane_entry(plan, lane, progress[lane]) for lane in lanes]


def build_state(identity: Identity, lanes: list[dict[str, int]]) -> dict[str, Any]:
    return {"format": STATE_FORMAT, "version": STATE_VERSION, **identity.header(), "lanes": lanes}


def build_part(
    identity: Identity,
    lanes: list[dict[str, int]],
    *,
    run_id: str,
    key: str,
    rank: int,
    world_size: int,
    dp_degree: int,
    dp_group_id: int,
    delivered: int,
) -> dict[str, Any]:
    """One rank's contribution to a distributed checkpoint: the lanes its group owns, and how
    many batches it delivered since its progress began (fresh or restored)."""
    return {
        "format": PART_FORMAT,
        "version": STATE_VERSION,
        "run_id": run_id,
        "key": key,
        "rank": rank,
        "world_size": world_size,
        "dp_degree": dp_degree,
        "dp_group_id": dp_group_id,
        "delivered": delivered,
        **identity.header(),
        "lanes": lanes,
    }


def _fail(field: str, value: Any, expected: Any, fix: str) -> PipelineStateError:
    return PipelineStateError(
        f"cannot restore pipeline state: {field} is {value!r}, expected {expected}; {fix}",
        field=field,
        value=value,
        expected=expected,
    )


def parse_state(state: Any, identity: Identity) -> dict[int, LaneProgress]:
    """Validate ``state`` against this pipeline and return every lane's progress.

    Raises ``PipelineStateError`` naming the first offending field.
    """
    if not isinstance(state, Mapping):
        raise _fail(
            "state",
            type(state).__name__,
            "a dict returned by Pipeline.checkpoint()",
            "pass the dict that checkpoint() returned",
        )
    if state.get("format") != STATE_FORMAT:
        raise _fail(
            "format",
            state.get("format"),
            repr(STATE_FORMAT),
            "this is not a Zephon pipeline state dict",
        )
    if state.get("version") != STATE_VERSION:
        raise _fail(
            "version",
            state.get("version"),
            STATE_VERSION,
            "it was written by an incompatible Zephon version",
        )
    if state.get("canonical_replicas") != identity.canonical_replicas:
        raise _fail(
            "canonical_replicas",
            state.get("canonical_replicas"),
            identity.canonical_replicas,
            "canonical_replicas must stay the same across restores (to resume on a different "
            "number of data-parallel ranks change dp_degree only)",
        )
    if state.get("flush_every_k_chunks") != identity.flush_every_k_chunks:
        raise _fail(
            "flush_every_k_chunks",
            state.get("flush_every_k_chunks"),
            identity.flush_every_k_chunks,
            "set options(flush_every_k_chunks=...) to the value of the run that saved the state",
        )
    if state.get("work_source") != identity.work_source:
        raise _fail(
            "work_source",
            state.get("work_source"),
            repr(identity.work_source),
            "the datasets (shard ids and their lengths), mixture, chunk_size, seed, "
            "shuffle_shards, stop_after_passes or exhausted_policy differ from the run that "
            "saved the state",
        )
    if state.get("operators") != identity.operators:
        raise _fail(
            "operators",
            state.get("operators"),
            repr(identity.operators),
            "the chain of map_transform/shuffle/pack_sequences differs from the run that saved "
            "the state; rebuild the same chain",
        )
    lanes = state.get("lanes")
    if (
        not isinstance(lanes, Sequence)
        or isinstance(lanes, (str, bytes))
        or len(lanes) != identity.canonical_replicas
    ):
        raise _fail(
            "lanes",
            type(lanes).__name__ if not isinstance(lanes, list) else f"a list of {len(lanes)}",
            f"a list of {identity.canonical_replicas} lanes",
            "the state dict is malformed",
        )
    k = max(identity.flush_every_k_chunks, 1)
    progress: dict[int, LaneProgress] = {}
    for i, entry in enumerate(lanes):
        values = _lane_values(entry, f"lanes[{i}]")
        if values["lane"] != i:
            raise _fail(f"lanes[{i}].lane", values["lane"], i, "the state dict is malformed")
        if values["flushed_chunks"] % k:
            raise _fail(
                f"lanes[{i}].flushed_chunks",
                values["flushed_chunks"],
                f"a multiple of {k}",
                "the state dict is malformed",
            )
        progress[i] = LaneProgress(
            values["flushed_chunks"] // k, values["delivered_since_flush"], values["batches"]
        )
    return progress


def _lane_values(entry: Any, where: str) -> dict[str, int]:
    if not isinstance(entry, Mapping):
        raise _fail(where, type(entry).__name__, "a dict", "the state dict is malformed")
    values = {}
    for name in _LANE_FIELDS:
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _fail(f"{where}.{name}", value, "an integer >= 0", "the state dict is malformed")
        values[name] = value
    return values


def merge_parts(
    parts: Sequence[Mapping[str, Any]], identity: Identity, *, run_id: str, url: str
) -> dict[str, Any]:
    """Assemble every rank's part into one state dict covering all lanes.

    Ranks of one data-parallel group read the same lanes, so their entries must agree; a
    disagreement means the ranks did not call ``checkpoint()`` at the same step.
    """
    by_lane: dict[int, tuple[int, dict[str, int]]] = {}
    for part in parts:
        rank = part.get("rank")
        if part.get("format") != PART_FORMAT or part.get("version") != STATE_VERSION:
            raise AggregationError(
                f"part of rank {rank} under {url} is not a version-{STATE_VERSION} Zephon "
                "pipeline part; remove it and checkpoint again",
                run_id=run_id,
                url=url,
            )
        for field, expected in identity.header().items():
            if part.get(field) != expected:
                raise AggregationError(
                    f"rank {rank} checkpointed a pipeline with {field}={part.get(field)!r}, "
                    f"rank 0 has {expected!r}: every rank must build the same pipeline",
                    run_id=run_id,
                    url=url,
                )
        for entry in part.get("lanes", []):
            values = _lane_values(entry, f"rank {rank} lane")
            lane = values["lane"]
            seen = by_lane.get(lane)
            if seen is not None and seen[1] != values:
                raise AggregationError(
                    f"ranks {seen[0]} and {rank} report different progress for lane {lane} "
                    f"({seen[1]} vs {values}): ranks of one data-parallel group must call "
                    "checkpoint() after the same step",
                    run_id=run_id,
                    url=url,
                )
            by_lane[lane] = (rank, values)
    missing = [lane for lane in range(identity.canonical_replicas) if lane not in by_lane]
    if missing:
        raise AggregationError(
            f"no rank reported lanes {missing}: every dp_group_id in range(dp_degree) needs at "
            "least one rank in world_size",
            run_id=run_id,
            url=url,
        )
    lanes = [by_lane[lane][1] for lane in range(identity.canonical_replicas)]
    return build_state(identity, lanes)
