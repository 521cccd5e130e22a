"""One rank of the auto-period test: ``python -m tests.zephon.goodput.period_worker RANK 2
PORT``. Both ranks train a tiny model under ``period_steps: auto``; rank 1's steps take
longer than rank 0's (its own measurement differs), yet both must save at the same steps:
rank 0's decisions."""

from __future__ import annotations

import time

import torch
from torch import nn

from tests.ranks import serve
from zephon import CheckpointingConfig, CheckpointManager


def scenario(rank: int, world: int, config: dict) -> dict:
    checkpointing = CheckpointingConfig(
        save_dir=config["save_dir"],
        catalog_url=config["catalog_url"],
        period_steps="auto",
        auto_period={"min_steps": 2, "max_steps": 30, "mtbf_s": 1},
    )
    model = nn.Linear(4, 2)
    saved, periods = [], []
    with CheckpointManager(checkpointing, run_name="r", total_steps=40) as manager:
        manager.load_latest({"model": model})
        for step in range(1, 41):
            time.sleep(0.01 * (1 + 2 * rank))
            with torch.no_grad():
                model.weight.add_(1.0)
            if manager.maybe_save(step, {"model": model}):
                saved.append(step)
                periods.append(manager.instruments.pacing.period)
        committed = manager.store.run("r").committed_steps()
    return {"saved": saved, "periods": periods, "committed": committed}


if __name__ == "__main__":
    serve(scenario)
