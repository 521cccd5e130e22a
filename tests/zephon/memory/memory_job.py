"""A tiny training job with the memory tier, run by ``torchrun`` on simulated nodes
(``tests/zephon/memory/test_memory_resume.py``): every node's host memory is the directory
in ``$ZEPHON_TEST_MEMORY_DIR``.

The model is replicated (every rank holds the same weights, the gradients are averaged), each
rank trains on data of its own, so a step's losses depend on the exact state restored. Every
rank appends ``{"step", "rank", "loss"}`` to ``<out>/losses-<rank>.jsonl``; rank 0 writes
``<out>/start.json`` (the step resumed from and the URL it was read from). ``die_at`` ends
every process once that step ran, before its save. ``crash_after``
ends every process at once, without closing anything, once that step's save is copied to
its peers and uploaded (the job dies; its nodes' memory stays).
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


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def main(spec: dict) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test asks a hung job where it is
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("zephon").setLevel(logging.INFO)
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = zephon.CheckpointingConfig(
        save_dir=spec["save_dir"],
        storage_options=spec.get("storage_options", {}),
        period_steps=spec["period"],
        memory_tier=spec.get("memory_tier", True),
        memory_dir=os.environ.get(MEMORY_ENV),
        catalog_url=spec.get("catalog_url"),
    )
    out = spec["out"]
    with zephon.CheckpointManager(config, run_name=spec["run"], total_steps=spec["steps"]) as m:
        state = {"model": model, "optimizer": optimizer}
        resume = m.load_latest(state)
        if rank == 0:
            with open(os.path.join(out, "start.json"), "w") as handle:
                json.dump({"step": resume.step, "url": resume.url}, handle)
        for step in range(resume.next_step, spec["steps"] + 1):
            x, y = batch(rank, step)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= world
            optimizer.step()
            with open(os.path.join(out, f"losses-{rank}.jsonl"), "a") as handle:
                handle.write(json.dumps({"step": step, "rank": rank, "loss": loss.item()}) + "\n")
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
