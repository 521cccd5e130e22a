"""A small but complete training (or inference) job on Zephon: a data pipeline, a model with
dropout, AdamW, an LR schedule in percent of ``total_steps``, a task and metrics, all saved by
the ``CheckpointManager`` and resumed exactly. ``zephon demo`` and the tests run it.

Run one rank per process::

    python -m zephon.demo.job '<spec JSON>'   # RANK / WORLD_SIZE / MASTER_PORT from the env

Each rank appends ``{"step", "loss"}`` lines to ``<out_dir>/<tag>-losses-r<rank>.jsonl`` (and,
for inference, the ids it processed to ``<tag>-outputs-r<rank>.jsonl``), and at the end writes
``<tag>-final-r<rank>.pt`` with its model and optimizer state.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zephon
from zephon.checkpointing import CheckpointManager
from zephon.config import ModelStageConfig
from zephon.demo.common import (
    checkpointing_of,
    in_memory_dataset,
    regression_rows,
    run_command_line,
    write_line,
)
from zephon.pipeline.torch_adapter import PipelineStateful

__all__ = ["JobSpec", "run", "main"]

FEATURES, TARGETS, LANES = 8, 2, 4


@dataclass(kw_only=True)
class JobSpec:
    save_dir: str
    out_dir: str
    tag: str = "run"
    run: str | None = "demo"
    kind: str = "train"
    total_steps: int = 12
    period_steps: int | str = 3
    num_to_keep: int | None = 2
    async_save: bool = False
    catalog_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    microbatch: int = 8
    seed: int = 0
    trainable_only: bool = False
    source_checkpoint: str | None = None
    #: sleep this long after each step, so a parent can preempt the job at a chosen point
    step_sleep_s: float = 0.0


def make_rows(count: int = 2048) -> list[dict[str, Any]]:
    return regression_rows(count, FEATURES, TARGETS)


def build_pipeline(spec: JobSpec, rank: int, world: int) -> zephon.Pipeline:
    source = zephon.StaticMixtureWorkSource(
        [in_memory_dataset("demo", make_rows())],
        None,
        chunk_size=64,
        seed=spec.seed,
        stop_after_passes=None if spec.kind == "train" else 1,
    )
    pipeline = zephon.Pipeline(source)
    if spec.kind == "train":
        pipeline = pipeline.shuffle(128, seed=spec.seed)
    return pipeline.batch(spec.microbatch, drop_last=False).options(
        world_size=world,
        global_rank=rank,
        dp_degree=world,
        dp_group_id=rank,
        canonical_replicas=LANES,
        aggregate_dir=os.path.join(spec.out_dir, "aggregate"),
        run_id=f"{spec.tag}-{spec.run}",
    )


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(32, TARGETS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def schedule(total_steps: int):
    """Warm up over the first 20% of the steps, then decay linearly to 10% at the end: phases in
    percent of total_steps, so they move when total_steps is raised."""
    warmup = max(1, round(0.2 * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.1, 1.0 - 0.9 * (step - warmup) / max(1, total_steps - warmup))

    return factor


class Task:
    """The task's own state: how many samples it trained on, and the last ids it saw."""

    def __init__(self) -> None:
        self.samples = 0
        self.last_ids: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "last_ids": list(self.last_ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = int(state["samples"])
        self.last_ids = list(state["last_ids"])


class Metrics:
    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.count = 0

    def update(self, loss: float) -> None:
        self.loss_sum += loss
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.loss_sum, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum, self.count = float(state["loss_sum"]), int(state["count"])


def average_gradients(params: list[torch.Tensor], world: int) -> None:
    """Data-parallel gradient averaging, one parameter at a time in a fixed order.

    DDP would overlap this with the backward pass, but it lays out its buckets again on the
    first iteration of every process, so a resumed process sums some gradient elements in
    another order than the original one did; this keeps resumption bit-for-bit on any number
    of ranks.
    """
    if world == 1:
        return
    for param in params:
        dist.all_reduce(param.grad)
        param.grad.div_(world)


def run(spec: JobSpec, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """One rank of the job. Returns a summary (resumed from, finished, last step)."""
    torch.set_num_threads(1)  # bit-for-bit repeatable arithmetic
    torch.manual_seed(spec.seed)
    model = Model()
    if spec.trainable_only:
        model.body.requires_grad_(False)  # a frozen base; only the head is trained
    torch.manual_seed(spec.seed * 1000 + rank)  # per-rank dropout stream
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(spec.total_steps))
    pipeline = build_pipeline(spec, rank, world)
    task, metrics = Task(), Metrics()
    state: dict[str, Any] = {
        "model": model,
        "data": PipelineStateful(pipeline),
        "task": task,
    }
    if spec.kind == "train":
        state.update(optimizer=optimizer, lr_scheduler=scheduler, metrics=metrics)
    config = checkpointing_of(spec, async_save=spec.async_save)
    stage = ModelStageConfig(
        checkpoint_only_trainable_parameters=spec.trainable_only,
        source_checkpoint=spec.source_checkpoint,
    )
    manager = CheckpointManager(
        config,
        run_name=spec.run if spec.kind == "train" else None,
        total_steps=spec.total_steps,
        kind=spec.kind,
        model_stage=stage,
    )
    losses = os.path.join(spec.out_dir, f"{spec.tag}-losses-r{rank}.jsonl")
    outputs = os.path.join(spec.out_dir, f"{spec.tag}-outputs-r{rank}.jsonl")
    try:
        resume = manager.load_latest(state)
        summary = {"resumed_from": resume.step, "finished": resume.finished, "last_step": None}
        if resume.finished:
            return summary
        batches = iter(pipeline)
        for step in range(resume.next_step, spec.total_steps + 1):
            batch = next(batches)
            ids = [r["id"] for r in batch.payloads]
            x = torch.tensor([r["x"] for r in batch.payloads])
            y = torch.tensor([r["y"] for r in batch.payloads])
            if spec.kind == "train":
                model.train()
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                average_gradients(params, world)
                optimizer.step()
                scheduler.step()
                metrics.update(loss.item())
                write_line(
                    losses, {"step": step, "loss": loss.item(), "lr": scheduler.get_last_lr()[0]}
                )
            else:
                model.eval()
                with torch.no_grad():
                    predictions = model(x)
                write_line(outputs, {"step": step, "ids": ids, "sum": float(predictions.sum())})
            task.samples += len(ids)
            task.last_ids = ids
            summary["last_step"] = step
            manager.maybe_save(step, state)
            if spec.step_sleep_s:
                time.sleep(spec.step_sleep_s)
        manager.finish()
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "task": task.state_dict(),
                "metrics": metrics.state_dict(),
            },
            os.path.join(spec.out_dir, f"{spec.tag}-final-r{rank}.pt"),
        )
        return summary
    finally:
        manager.close()
        pipeline.close()


def join(world: int) -> int:
    """This rank (``RANK``) in the gloo group whose rank 0 listens on 127.0.0.1:MASTER_PORT."""
    rank = int(os.environ["RANK"])
    init_method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init_method)
    return rank


def main() -> None:
    run_command_line(run, JobSpec, join)


if __name__ == "__main__":
    main()
