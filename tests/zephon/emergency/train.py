"""A deterministic tiny training job for the save-on-preemption tests: ``python -m
tests.zephon.emergency.train RANK WORLD PORT``, its configuration (JSON) in
``$ZEPHON_RANK_CONFIG``:

- ``checkpointing``: ``CheckpointingConfig`` keywords (``emergency_save`` among them);
- ``run``, ``total_steps``, ``step_s`` (a pause in the middle of each optimizer update, so a
  signal often lands between its two halves; from step ``pause_from`` on, 1 by default),
  ``losses`` (a path prefix: each rank appends ``<step> <loss as float.hex>`` to
  ``<losses>.<rank>``), ``slow_save_s`` (each save's state
  capture pauses this long after printing ``IN_SAVE``, so a test can signal during a save),
  ``ballast_mb`` (a tensor of this many MiB in the state, constant: a save that takes a while
  without a pause in the state's capture, for ``when: now``, whose capture is at the boundary).

Each step: the same data for a given (step, rank), dropout from the global RNG (restored on
resume), gradients averaged over the ranks in a fixed order, then two Adam optimizers update
the two halves of the model with a pause between them: an emergency save taken from inside the
step would capture half-updated parameters, and the resumed losses would differ.

Prints ``RESUMED <next step>``, ``STEP <n>`` after each step and ``DONE`` at the end; a
preempted rank exits with ``zephon.Preempted``'s code (143 for SIGTERM).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tests.ranks import join_group, rank_config


class SlowProgress:
    """A stateful entry whose capture can be slowed down (``slow_save_s``): a save is under
    way while it sleeps."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        if self.pause_s:
            print("IN_SAVE", flush=True)
            time.sleep(self.pause_s)
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


def main() -> None:
    rank, world, port = (int(arg) for arg in sys.argv[1:4])
    config = rank_config()
    join_group(rank, world, port, timeout=180)
    import torch
    import torch.distributed as dist
    from torch import nn

    import zephon

    torch.manual_seed(1234)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
    params = list(model.parameters())
    first = torch.optim.Adam(params[:2], lr=1e-2)
    second = torch.optim.Adam(params[2:], lr=1e-2)
    progress = SlowProgress(float(config.get("slow_save_s", 0)))
    state = {"model": model, "first": first, "second": second, "progress": progress}
    ballast = int(config.get("ballast_mb", 0))
    if ballast:
        state["ballast"] = torch.ones(ballast * 2**18)  # float32: 4 bytes each
    torch.manual_seed(99 + rank)  # dropout differs per rank; each rank's RNG is saved
    checkpointing = zephon.CheckpointingConfig(**config["checkpointing"])
    total, pause = int(config["total_steps"]), float(config["step_s"])
    pause_from = int(config.get("pause_from", 1))
    losses = f"{config['losses']}.{rank}"
    with zephon.CheckpointManager(
        checkpointing, run_name=config["run"], total_steps=total
    ) as manager:
        resume = manager.load_latest(state)
        print(f"RESUMED {resume.next_step}", flush=True)
        for step in range(resume.next_step, total + 1):
            data = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, 8, generator=data)
            y = x.sum(dim=1, keepdim=True).sin()
            first.zero_grad()
            second.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            for param in params:  # averaged in a fixed order: bit-for-bit on resume
                dist.all_reduce(param.grad)
                param.grad /= world
            first.step()
            if step >= pause_from:
                time.sleep(pause)  # half of the model updated: a torn state if saved now
            second.step()
            progress.steps += 1
            with open(losses, "a") as out:
                out.write(f"{step} {loss.item().hex()}\n")
            print(f"STEP {step}", flush=True)
            manager.maybe_save(step, state)
        manager.finish()
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
