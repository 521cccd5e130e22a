"""What the demo's two jobs (``job.py`` and ``elastic_job.py``) share: their synthetic regression
records, an in-memory dataset of them, durable JSON lines, and the command line that runs one
rank of a job."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import zephon
from zephon.config import CheckpointingConfig

__all__ = [
    "checkpointing_of",
    "in_memory_dataset",
    "regression_rows",
    "run_command_line",
    "write_line",
]


def regression_rows(
    count: int,
    features: int,
    targets: int,
    link: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """``count`` records ``{"id", "x", "y"}`` of a fixed random regression problem, ``y = link(x
    @ w)`` plus a little noise: the same on every rank and in every process (seed 1234)."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(count, features, generator=generator)
    w = torch.randn(features, targets, generator=generator)
    signal = x @ w if link is None else link(x @ w)
    y = signal + 0.1 * torch.randn(count, targets, generator=generator)
    return [{"id": i, "x": x[i].tolist(), "y": y[i].tolist()} for i in range(count)]


def in_memory_dataset(name: str, rows: list[dict[str, Any]], shards: int = 8) -> zephon.Dataset:
    """The records dealt round-robin into ``shards`` in-memory shards ``shard-00``, ..."""
    parts = {f"shard-{s:02d}": zephon.InMemoryShard(rows[s::shards]) for s in range(shards)}
    return zephon.Dataset.from_dict(name, parts)


def checkpointing_of(spec: Any, **extra: Any) -> CheckpointingConfig:
    """The checkpointing a job's spec asks for: its ``save_dir``, ``period_steps``,
    ``num_to_keep``, ``catalog_url`` and ``storage_options``, and any ``extra`` field."""
    return CheckpointingConfig(
        save_dir=spec.save_dir,
        period_steps=spec.period_steps,
        num_to_keep=spec.num_to_keep,
        catalog_url=spec.catalog_url,
        storage_options=spec.storage_options,
        **extra,
    )


def write_line(path: str, value: dict[str, Any], mode: str = "a") -> None:
    """Write ``value`` as one JSON line and fsync it: a rank SIGKILLed right after still left
    it, for the parent process that reads it."""
    with open(path, mode) as handle:
        handle.write(json.dumps(value) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def run_command_line(
    run: Callable[[Any, int, int], dict[str, Any]],
    spec_type: type,
    join: Callable[[int], int],
) -> None:
    """``python -m <job> '<spec JSON>'``: one rank of the job, ``WORLD_SIZE`` ranks in all (1 if
    unset). With more than one, ``join(world)`` joins the process group and returns this rank.
    Rank 0 prints the summary ``run`` returns as one JSON line."""
    spec = spec_type(**json.loads(sys.argv[1]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = join(world) if world > 1 else 0
    try:
        summary = run(spec, rank, world)
        if rank == 0:
            print(json.dumps(summary), flush=True)
    finally:
        if world > 1:
            dist.destroy_process_group()
