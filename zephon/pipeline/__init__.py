"""Zephon's data pipeline: exact, elastic checkpoint and restore with bounded replay.

``Dataset`` -> ``StaticMixtureWorkSource`` (a deterministic curriculum of work chunks over
``canonical_replicas`` lanes) -> ``Pipeline`` operators (``map_transform``, ``shuffle``,
``pack_sequences``, ``batch``, ``prefetch``) -> batches for the training loop.
``Pipeline.checkpoint()`` returns per-lane progress; ``Pipeline.restore()`` re-reads at most one
flush window per lane. This package never imports torch; ``zephon.pipeline.torch_adapter`` does.
"""

from __future__ import annotations

from zephon.pipeline.dataset import Dataset
from zephon.pipeline.elastic import check_elastic_config
from zephon.pipeline.errors import (
    AggregationError,
    AggregationTimeoutError,
    DataSourceError,
    PipelineError,
    PipelineStateError,
)
from zephon.pipeline.mixture import MixtureSpec
from zephon.pipeline.pipeline import Pipeline, PipelineOptions
from zephon.pipeline.records import Batch, Record
from zephon.pipeline.shards import InMemoryShard, JsonlShard, ParquetShard, Shard
from zephon.pipeline.work_source import Chunk, StaticMixtureWorkSource

__all__ = [
    "AggregationError",
    "AggregationTimeoutError",
    "Batch",
    "Chunk",
    "DataSourceError",
    "Dataset",
    "InMemoryShard",
    "JsonlShard",
    "MixtureSpec",
    "ParquetShard",
    "Pipeline",
    "PipelineError",
    "PipelineOptions",
    "PipelineStateError",
    "Record",
    "Shard",
    "StaticMixtureWorkSource",
    "check_elastic_config",
]
