"""A training job whose every step is the same records and the same arithmetic on any layout:
1, 2 or 4 ranks, on one node or several. The multi-node tests run it under ``torchrun``.

Launch one agent per node (each node with its own working directory; nothing shared but the
checkpoint storage and the catalog)::

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT --rdzv-id RUN -m zephon.demo.elastic_job '<spec JSON>'

Why it is exact across layouts. The pipeline has ``canonical_replicas`` lanes whatever the
number of ranks; a lane's microbatches are the same records in the same order on any layout
(docs/pipeline.md, "Elastic resumption"), and every optimizer step takes one microbatch from
every lane. Each rank computes, for each lane it owns, the summed loss and its gradient on that
lane's microbatch alone; the ranks all-gather these per-lane rows and every rank adds them in
lane order 0, 1, ..., L-1 and scales by ``1 / records``. Neither the rows nor the order of the
additions depend on how many ranks there are, so the loss, the gradient and the update are
equal bit for bit on 2 ranks and on 4 (an all-reduce would add the ranks' partial sums in an
order that depends on the world size, and differ in the last bits). The model is replicated:
every rank applies the same update to the same parameters.

Rank 0 writes to ``out_dir`` (relative to the node's working directory):

- ``start.json``: the step resumed from and the layout;
- ``steps.jsonl``: per step the loss and the global batch, every lane's sample ids;
- ``final.pt``: the model and optimizer state at the end;
- ``held.json``, with ``hold_after_step``: once that step (and its save, if any) is done, so a
  test can SIGKILL the node at a known point. Rank 0 then waits to be killed; every other rank
  waits for it in a barrier, which fails when rank 0's node dies.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zephon
from zephon.checkpointing import CheckpointManager
from zephon.demo.common import (
    checkpointing_of,
    in_memory_dataset,
    regression_rows,
    run_command_line,
    write_line,
)
from zephon.pipeline.torch_adapter import PipelineStateful

__all__ = ["ElasticSpec", "run", "main"]

FEATURES, HIDDEN, TARGETS = 8, 16, 2


@dataclass(kw_only=True)
class ElasticSpec:
    save_dir: str
    catalog_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    run: str = "elastic"
    total_steps: int = 8
    period_steps: int = 2
    num_to_keep: int | None = 2
    #: canonical_replicas: fixed for the life of the run, whatever the number of ranks
    lanes: int = 4
    microbatch: int = 4
    seed: int = 0
    #: rank 0's outputs, relative to the working directory (the node's own)
    out_dir: str = "."
    #: None: the pipeline's progress is aggregated over torch.distributed (nothing shared on
    #: disk); a URL every rank reaches: through storage there (pipelines without a process group)
    aggregate_dir: str | None = None
    #: after this step rank 0 writes held.json and waits to be killed
    hold_after_step: int | None = None


def make_rows(count: int = 1024) -> list[dict[str, Any]]:
    return regression_rows(count, FEATURES, TARGETS, link=torch.tanh)


def build_pipeline(spec: ElasticSpec, rank: int, world: int) -> zephon.Pipeline:
    """Every rank is its own data-parallel group; ``spec.lanes`` lanes on any world size."""
    # One microbatch per lane per optimizer step: each of the `world` groups reads lanes/world.
    zephon.check_elastic_config(
        spec.lanes, world, spec.microbatch, microbatches_per_step=spec.lanes // world
    )
    source = zephon.StaticMixtureWorkSource(
        [in_memory_dataset("elastic", make_rows())],
        None,
        chunk_size=16,
        seed=spec.seed,
        stop_after_passes=None,
    )
    topology: dict[str, Any] = {
        "world_size": world,
        "global_rank": rank,
        "dp_degree": world,
        "dp_group_id": rank,
        "canonical_replicas": spec.lanes,
        "run_id": spec.run,
    }
    if world > 1 and spec.aggregate_dir is None:
        topology["aggregate_store"] = "torch://"
    elif world > 1:
        topology.update(aggregate_dir=spec.aggregate_dir, storage_options=spec.storage_options)
    pipeline = zephon.Pipeline(source).shuffle(32, seed=spec.seed).batch(spec.microbatch)
    return pipeline.options(**topology)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, TARGETS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def lane_row(model: Model, params: list[torch.Tensor], batch: zephon.Batch) -> torch.Tensor:
    """``[summed loss, its gradient flattened]`` of one lane's microbatch: what the lane adds to
    the step, computed from that microbatch alone."""
    x = torch.tensor([r["x"] for r in batch.payloads])
    y = torch.tensor([r["y"] for r in batch.payloads])
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y, reduction="sum")
    loss.backward()
    return torch.cat([loss.detach().reshape(1), *(p.grad.reshape(-1) for p in params)])


def global_step(
    model: Model, params: list[torch.Tensor], batches: list[zephon.Batch], lanes: int
) -> float:
    """Set every parameter's gradient to the mean over the global batch; returns its loss.

    The per-lane rows of every rank are gathered and added in lane order, so the result is
    the same bits on any world size (see the module docstring)."""
    mine = torch.stack([lane_row(model, params, b) for b in batches])
    ids = torch.tensor([b.lane for b in batches])
    records = sum(len(b) for b in batches)
    if dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        rows, owners = (
            [torch.empty_like(mine) for _ in range(world)],
            [torch.empty_like(ids) for _ in range(world)],
        )
        dist.all_gather(rows, mine)
        dist.all_gather(owners, ids)
        count = torch.tensor([records])
        dist.all_reduce(count)  # an integer: exact in any order
        records = int(count)
        by_lane = {
            int(lane): row
            for part, lane_ids in zip(rows, owners, strict=True)
            for lane, row in zip(lane_ids, part, strict=True)
        }
    else:
        by_lane = {int(lane): row for lane, row in zip(ids, mine, strict=True)}
    if sorted(by_lane) != list(range(lanes)):
        raise zephon.ZephonError(
            f"a step must take one microbatch from each of the {lanes} lanes, got lanes "
            f"{sorted(by_lane)}: keep lanes divisible by the world size"
        )
    total = by_lane[0].clone()
    for lane in range(1, lanes):
        total += by_lane[lane]
    total /= records * TARGETS  # mse: the mean over every element of the global batch
    offset = 1
    for p in params:
        p.grad = total[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return float(total[0])


def global_batch(batches: list[zephon.Batch]) -> dict[str, list[str]]:
    """lane -> sample ids of this step, over all ranks (on every rank)."""
    mine = {str(b.lane): b.sample_ids for b in batches}
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged = {lane: ids for part in parts for lane, ids in part.items()}
    return {lane: merged[lane] for lane in sorted(merged, key=int)}


def run(spec: ElasticSpec, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """One rank of the job. Returns a summary (resumed from, last step)."""
    torch.set_num_threads(1)  # one kernel order on every rank
    torch.manual_seed(spec.seed)  # the same initial parameters on every rank
    model = Model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    pipeline = build_pipeline(spec, rank, world)
    state = {
        "model": model,
        "optimizer": optimizer,
        "lr_scheduler": scheduler,
        "data": PipelineStateful(pipeline),
    }
    config = checkpointing_of(spec)
    manager = CheckpointManager(config, run_name=spec.run, total_steps=spec.total_steps)
    out = spec.out_dir
    try:
        resume = manager.load_latest(state)
        summary = {"resumed_from": resume.step, "world": world, "last_step": None}
        if rank == 0:
            os.makedirs(out, exist_ok=True)
            write_line(os.path.join(out, "start.json"), summary, mode="w")
        if resume.finished:
            return summary
        batches = iter(pipeline)
        per_step = spec.lanes // world
        for step in range(resume.next_step, spec.total_steps + 1):
            mine = [next(batches) for _ in range(per_step)]
            loss = global_step(model, params, mine, spec.lanes)
            optimizer.step()
            scheduler.step()
            lanes = global_batch(mine)
            if rank == 0:
                record = {"step": step, "loss": loss, "lanes": lanes}
                write_line(os.path.join(out, "steps.jsonl"), record)
            summary["last_step"] = step
            manager.maybe_save(step, state)
            if step == spec.hold_after_step:
                hold(out, step, rank)
        manager.finish()
        if rank == 0:
            final = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(final, os.path.join(out, "final.pt"))
        return summary
    finally:
        manager.close()
        pipeline.close()


def hold(out: str, step: int, rank: int) -> None:
    """Stop after ``step`` until killed: rank 0 says so in held.json and sleeps; the others
    wait for it in a barrier, which raises once rank 0's node is gone."""
    if rank == 0:
        write_line(os.path.join(out, "held.json"), {"step": step, "pid": os.getpid()}, mode="w")
        while True:
            time.sleep(1)
    dist.barrier()
    raise zephon.ZephonError(f"rank 0 passed the hold after step {step}; it must be killed there")


def join(world: int) -> int:
    """This rank in the gloo group torchrun's environment describes (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT)."""
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
    return dist.get_rank()


def main() -> None:
    run_command_line(run, ElasticSpec, join)


def spec_json(spec: ElasticSpec) -> str:
    """The spec as the one command-line argument ``main`` takes."""
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    main()
