"""A tiny training job with the memory tier, run by ``torchrun`` on simulated nodes
(``tests/zephon/memory/test_memory_resume.py``): every node's host memory is the directory
in ``$ZEPHON_TEST_MEMORY_DIR``, its local disk (if any) ``$ZEPHON_TEST_LOCAL_DIR``.

The model is replicated (every rank holds the same weights; the gradients are all-gathered and
summed in rank order, so the same bits on any layout), each rank trains on data of its own, so a
step's losses depend on the exact state restored; ``reference_losses`` computes the
uninterrupted run's in one process. Every
rank appends ``{"step", "rank", "loss"}`` to ``<out>/losses-<rank>.jsonl``; rank 0 writes
``<out>/start.json`` (the step resumed from and the URL it was read from). ``die_at`` ends
every process once that step ran, before its save. ``crash_after``
ends every process at once, without closing anything, once that step's save is copied to
its peers and uploaded (the job dies; its nodes' memory stays). ``table_kib`` adds a table
sharded over the ranks, which a resume must bring back as saved (exit 19 otherwise).
"""

from __future__ import annotations

import datetime as dt
import faulthandler
import json
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import zephon

MEMORY_ENV = "ZEPHON_TEST_MEMORY_DIR"
#: the node's local disk behind its memory, if the test gives one
LOCAL_ENV = "ZEPHON_TEST_LOCAL_DIR"


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _losses_and_grads(model: nn.Module, rank: int, step: int) -> tuple[float, list]:
    x, y = batch(rank, step)
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _apply(model: nn.Module, optimizer, every: list[list[torch.Tensor]]) -> None:
    """The ranks' gradients summed in rank order (the same bits on any layout), averaged."""
    for index, parameter in enumerate(model.parameters()):
        total = every[0][index].clone()
        for grads in every[1:]:
            total += grads[index]
        parameter.grad = total / len(every)
    optimizer.step()


def train_step(model: nn.Module, optimizer, rank: int, world: int, step: int) -> float:
    """One step on every rank: each rank's gradient all-gathered and summed in rank order."""
    loss, grads = _losses_and_grads(model, rank, step)
    every: list = [None] * world
    dist.all_gather_object(every, grads)
    _apply(model, optimizer, every)
    return loss


def reference_losses(world: int, steps: int) -> dict[tuple[int, int], float]:
    """The uninterrupted run's losses, every rank's, computed in one process: the model is
    replicated, so one copy stands for every rank's."""
    model, optimizer = build()
    found = {}
    for step in range(1, steps + 1):
        every = []
        for rank in range(world):
            loss, grads = _losses_and_grads(model, rank, step)
            found[(step, rank)] = loss
            every.append(grads)
        _apply(model, optimizer, every)
    return found


def _table_values(rows: int, world: int) -> torch.Tensor:
    return torch.arange(rows * world * 64, dtype=torch.float32).reshape(rows * world, 64)


def _table(kib: int | None, world: int):
    """``table_kib``: a table of ``kib`` KiB per rank, sharded by rows over the ranks (a
    DTensor: each rank saves and loads its own rows only), never trained. -1 everywhere until
    ``_check_table`` fills a fresh start's."""
    if not kib:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rows = kib * 1024 // (64 * 4)
    mesh = init_device_mesh("cpu", (world,))
    table = nn.Module()  # a module's state: one key on every rank, each holding its rows
    table.register_buffer(
        "rows", distribute_tensor(torch.full((rows * world, 64), -1.0), mesh, [Shard(0)])
    )
    return table


def _check_table(table, world: int, resumed: bool) -> None:
    """A fresh start fills the table; a resume must have loaded it whole (exit 19 if not)."""
    local = table.rows.to_local()
    rows = local.shape[0]
    expected = _table_values(rows, world)[dist.get_rank() * rows : (dist.get_rank() + 1) * rows]
    if not resumed:
        local.copy_(expected)
    elif not torch.equal(local, expected):
        print(f"rank {dist.get_rank()}: the table was not loaded as saved", flush=True)
        os._exit(19)


def main(spec: dict) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test asks a hung job where it is
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("zephon").setLevel(logging.INFO)
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build()
    config = zephon.CheckpointingConfig(
        save_dir=spec["save_dir"],
        storage_options=spec.get("storage_options", {}),
        period_steps=spec["period"],
        memory_tier=spec.get("memory_tier", True),
        memory_dir=os.environ.get(MEMORY_ENV),
        local_dir=os.environ.get(LOCAL_ENV),
        catalog_url=spec.get("catalog_url"),
    )
    out = spec["out"]
    with zephon.CheckpointManager(config, run_name=spec["run"], total_steps=spec["steps"]) as m:
        state = {"model": model, "optimizer": optimizer}
        table = _table(spec.get("table_kib"), world)
        if table is not None:
            state["table"] = table
        resume = m.load_latest(state)
        if table is not None:
            _check_table(table, world, resumed=resume.step is not None)
        if rank == 0:
            with open(os.path.join(out, "start.json"), "w") as handle:
                json.dump({"step": resume.step, "url": resume.url}, handle)
        for step in range(resume.next_step, spec["steps"] + 1):
            loss = train_step(model, optimizer, rank, world, step)
            with open(os.path.join(out, f"losses-{rank}.jsonl"), "a") as handle:
                handle.write(json.dumps({"step": step, "rank": rank, "loss": loss}) + "\n")
            if step == spec.get("die_at"):  # dies before this step's save
                dist.barrier()
                os._exit(18)
            m.maybe_save(step, state)
            if step == spec.get("crash_after"):
                m.wait()  # the peer copies and the upload are done: then the job dies
                dist.barrier()
                os._exit(17)
        m.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
