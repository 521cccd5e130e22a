"""One rank of a 2-rank job in which rank 1 cannot save or load its part: every rank must raise
instead of waiting forever in a collective.

    python -m tests.zephon.failing_rank_child '<json>'   # RANK / WORLD_SIZE / MASTER_PORT
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig


def main() -> None:
    args = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    config = CheckpointingConfig(save_dir=args["save_dir"])
    outcome = {}
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        state = {"model": model, "extra": object() if rank == 1 else {"fine": True}}
        try:
            manager.save(1, state)
            outcome["save"] = "saved"
        except Exception as exc:
            outcome["save"] = f"{type(exc).__name__}: {exc}"
        manager.save(2, {"model": model})
        bigger = torch.nn.Linear(3, 4) if rank == 1 else torch.nn.Linear(3, 3)
        try:
            manager.load_latest({"model": bigger})
            outcome["load"] = "loaded"
        except Exception as exc:
            outcome["load"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(outcome), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
