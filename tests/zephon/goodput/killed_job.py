"""A training job that the goodput test SIGKILLs: ``python -m tests.zephon.goodput.killed_job
SAVE_DIR CATALOG_URL``. It saves every 2 steps (the state of tests/zephon/test_manager.py),
prints ``saved <step>`` after the saves of steps 2 and 4, then trains on, saving nothing more,
until it is killed."""

from __future__ import annotations

import sys
import time

from tests.zephon.test_manager import Counter, build, state_of
from zephon import CheckpointingConfig, CheckpointManager


def main(save_dir: str, catalog_url: str) -> None:
    config = CheckpointingConfig(save_dir=save_dir, catalog_url=catalog_url, period_steps=2)
    state = state_of(*build(), Counter())
    with CheckpointManager(config, run_name="r", total_steps=1000) as manager:
        manager.load_latest(state)
        for step in range(1, 1001):
            time.sleep(0.05)
            if manager.maybe_save(step, state) and step <= 4:
                print(f"saved {step}", flush=True)
            if step == 4:
                manager.config.period_steps = "disable"  # no record after step 4's save
        time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:3])
