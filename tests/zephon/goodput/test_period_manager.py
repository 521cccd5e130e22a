"""``period_steps: auto`` in a real ``CheckpointManager``: it saves at the period it measured,
logs each change in one line, takes the run's MTBF from the catalog's attempts, and every rank
saves at the steps rank 0 decided (two gloo ranks, slow)."""

from __future__ import annotations

import logging
import re
import time

import pytest
from torch import nn

from tests.ranks import launch
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig

CHANGE = re.compile(
    r"^zephon: save period (\d+) -> (\d+) steps "
    r"\(stall [0-9.e+-]+ s, step [0-9.e+-]+ s, MTBF [0-9.]+ h\)$"
)


def config_for(tmp_path, **auto) -> CheckpointingConfig:
    return CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        period_steps="auto",
        auto_period={"min_steps": 2, "max_steps": 40, "mtbf_s": 1, **auto},
    )


def test_the_manager_saves_at_the_period_it_measured(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="zephon")
    model = nn.Linear(4, 2)
    saves: list[tuple[int, int]] = []
    with CheckpointManager(config_for(tmp_path), run_name="r") as manager:
        manager.load_latest({"model": model})
        for step in range(1, 81):
            time.sleep(0.01)
            if manager.maybe_save(step, {"model": model}):
                saves.append((step, manager.instruments.pacing.period))
        committed = manager.store.run("r").committed_steps()
    assert committed == [step for step, _ in saves]
    assert saves[0][0] == 2  # the first period is min_steps: that save measures the next
    for (step, period), (after, _) in zip(saves, saves[1:], strict=False):
        assert after - step == period and 2 <= period <= 40
    changes = [CHANGE.match(r.getMessage()) for r in caplog.records if "save period" in r.message]
    assert changes and all(changes), [r.getMessage() for r in caplog.records]
    assert changes[0].group(1) == "2"
    assert [int(m.group(2)) for m in changes][-1] == saves[-1][1]


def test_a_fixed_period_has_no_policy(tmp_path):
    config = CheckpointingConfig(save_dir=str(tmp_path / "ckpt"), period_steps=3)
    with CheckpointManager(config, run_name="r") as manager:
        assert manager.instruments.pacing is None
        assert [s for s in range(1, 10) if manager.should_save(s)] == [3, 6, 9]


def test_the_mtbf_comes_from_the_runs_attempts(tmp_path):
    config = config_for(tmp_path, mtbf_s=1_000_000)
    model = nn.Linear(4, 2)
    with CheckpointManager(config, run_name="r") as manager:
        manager.load_latest({"model": model})
        # one attempt, alive for under a minute: the prior plus that
        assert 1_000_000 <= manager.instruments.mtbf_s() < 1_000_060
        manager.save(1, {"model": model})
    with CheckpointManager(config, run_name="r") as manager:
        resume = manager.load_latest({"model": model})
        assert resume.step == 1
        # a restart: (lifetime + prior) over two attempts
        assert 500_000 <= manager.instruments.mtbf_s() < 500_060
        # the resumed job's first save is min_steps after its resume step
        assert [s for s in range(2, 6) if manager.should_save(s)] == [3, 4, 5]
    with Catalog(config.catalog_url) as catalog:
        assert len(catalog.list_attempts("r")) == 2


@pytest.mark.slow
def test_every_rank_saves_at_the_steps_rank_0_decided(tmp_path):
    config = {
        "save_dir": str(tmp_path / "ckpt"),
        "catalog_url": f"sqlite:///{tmp_path / 'catalog.db'}",
    }
    ranks = launch("tests.zephon.goodput.period_worker", 2, config, timeout=600)
    assert ranks[0]["saved"] == ranks[1]["saved"] == ranks[0]["committed"]
    assert ranks[0]["periods"] == ranks[1]["periods"]
    assert ranks[0]["saved"][0] == 2 and ranks[0]["periods"][0] != 2  # rank 0 changed it
