"""A save records its phases on its catalog row: ``Save`` measures ``write_s``, ``commit_s``
and ``total_s`` (begin -> commit call -> marker -> catalog commit), callers add theirs
(``committed(timings=)``, ``add_timings``). Real saves: the checkpoint manager on torch DCP
with a SQLite catalog, and ``Save`` on local storage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.zephon.saves import start
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig
from zephon.locations import RunLocation
from zephon.saving import Save
from zephon.storage import CheckpointStore

MEASURED = {"write_s", "commit_s", "total_s"}


def _assert_phases_add_up(timings: dict[str, float]) -> None:
    assert set(timings) >= MEASURED
    assert all(isinstance(v, float) and v >= 0 for v in timings.values())
    # total_s is measured last from the same clock: it holds the two phases before it.
    assert timings["write_s"] + timings["commit_s"] <= timings["total_s"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_manager_save_leaves_its_phases_on_the_row(tmp_path, async_save):
    config = CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        period_steps=1,
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        async_save=async_save,
    )
    model = nn.Linear(64, 64)
    with CheckpointManager(config, run_name="r", total_steps=4) as manager:
        manager.save(2, {"model": model})
        manager.wait()
    with Catalog(config.catalog_url) as catalog:
        row = catalog.get_checkpoint("r", 2)
    assert row.state == "committed" and row.bytes > 64 * 64 * 4
    _assert_phases_add_up(row.timings)


def test_a_save_merges_the_callers_phases_and_later_ones(tmp_path):
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog(url) as catalog:
        catalog.ensure_run("r", str(tmp_path / "ckpt"))
        attempt = start(RunLocation("r", CheckpointStore(str(tmp_path / "ckpt")), "r"), catalog)
        save = Save.begin(attempt, 7, catalog=catalog)
        save.writer.write_bytes("a.bin", b"x" * 1000)
        save.commit()
        save.committed(timings={"stall_s": 0.25, "stage_s": 0.125})
        save.add_timings({"upload_s": 3.5, "stall_s": 0.5})
        row = catalog.get_checkpoint("r", 7)
        _assert_phases_add_up(row.timings)
        assert row.timings == save.timings
        assert (row.timings["stall_s"], row.timings["stage_s"]) == (0.5, 0.125)
        assert row.timings["upload_s"] == 3.5

        # A phase name nobody reads is refused in one line, and the row keeps its timings.
        with pytest.raises(ValueError, match="expected one of stall_s"):
            save.add_timings({"stall": 1.0})
        assert catalog.get_checkpoint("r", 7).timings == save.timings


def test_a_writer_committed_directly_still_times_its_commit(tmp_path):
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog(url) as catalog:
        catalog.ensure_run("r", str(tmp_path / "ckpt"))
        attempt = start(RunLocation("r", CheckpointStore(str(tmp_path / "ckpt")), "r"), catalog)
        with Save.begin(attempt, 1, catalog=catalog) as writer:
            writer.write_bytes("a.bin", torch.arange(10).numpy().tobytes())
            writer.commit()
        _assert_phases_add_up(catalog.get_checkpoint("r", 1).timings)
