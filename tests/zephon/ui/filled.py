"""A catalog filled by real runs of the checkpoint manager, for the dashboard's tests and
screenshots: everything ``zephon ui`` shows happens in it for real.

- run ``alpha`` (local tier, so every save has a local and a save_dir copy, and upload lag):
  attempt 1 saves every 2 steps and is preempted by SIGUSR1 at step 7 (an emergency save);
  attempt 2 resumes and trains to step 10, retention (``num_to_keep=3``) deleting older
  saves; step 4 is pinned; attempt 3 finds step 10 damaged, quarantines it (``corrupt``) and
  resumes from step 8.
- run ``beta``: a short plain run that finished.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

import zephon
from zephon.catalog import Catalog


def _state(model: nn.Module) -> dict:
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def _train(manager, state, stop: int, *, signal_at: int | None = None) -> None:
    for step in range(manager.load_latest(state).next_step, stop + 1):
        if step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        manager.maybe_save(step, state)


def _flip_a_byte(directory: str, run: str, step: int) -> None:
    """Damage the copy of ``step`` under ``directory`` (save_dir or the local tier)."""
    from tests.zephon.saves import flip_a_tensor_byte
    from zephon.storage import CheckpointStore

    flip_a_tensor_byte(CheckpointStore(directory).run(run).reader(step).path)


def fill(root: str) -> str:
    """Fill a SQLite catalog under ``root`` with the runs of the module docstring; its URL."""
    url = f"sqlite:///{root}/catalog.db"
    save_dir = f"{root}/ckpt"
    config = zephon.CheckpointingConfig(
        save_dir=save_dir,
        period_steps=2,
        num_to_keep=3,
        catalog_url=url,
        local_dir=f"{root}/local",
        emergency_save={"signals": ["SIGUSR1"], "grace_s": 60},
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    try:
        with zephon.CheckpointManager(config, run_name="alpha", total_steps=10) as manager:
            _train(manager, _state(model), 10, signal_at=7)
    except zephon.Preempted:
        pass
    with Catalog(url) as catalog:
        catalog.pin("alpha", 4)
    with zephon.CheckpointManager(config, run_name="alpha", total_steps=10) as manager:
        _train(manager, _state(model), 10)
    _flip_a_byte(save_dir, "alpha", 10)
    # attempt 3 restarts on another node: no local copy, so it reads save_dir's damaged one
    config.local_dir = None
    # (asked for 12 steps: a finished run's start loads nothing, so would meet no damage)
    with zephon.CheckpointManager(config, run_name="alpha", total_steps=12) as manager:
        resumed = manager.load_latest(_state(model))
    assert resumed.step == 8, resumed
    plain = zephon.CheckpointingConfig(
        save_dir=save_dir, period_steps=3, num_to_keep=3, catalog_url=url
    )
    with zephon.CheckpointManager(plain, run_name="beta", total_steps=6) as manager:
        _train(manager, _state(nn.Linear(4, 2)), 6)
    return url


if __name__ == "__main__":
    import sys

    print(fill(sys.argv[1]))
