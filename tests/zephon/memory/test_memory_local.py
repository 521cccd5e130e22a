"""``local_dir`` behind the memory tier, in one process (docs/memory.md, "A local disk behind
memory"): the config takes both; a save lands in memory, then in local_dir (committed,
CRC32C), then on save_dir, with a replica row per tier; local_dir keeps
``local_num_to_keep``; a failed local copy is one warning and a failed row while the upload
goes on; a resume whose memory is gone reads local_dir, and a damaged local copy gives way to
save_dir; a memory save the lineage no longer admits gives way to the local copy; the drop-in
Writer takes both tiers. The multi-node resumes run as real processes in
``test_memory_local_resume.py``.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from rich.console import Console
from torch import nn

import zephon
from tests.zephon.memory.cluster import strip_tensors
from tests.zephon.saves import largest_tensor_slice
from zephon.catalog import Catalog
from zephon.cli import render
from zephon.errors import ConfigError
from zephon.storage import CheckpointStore


def _config(tmp_path, catalog_url: str | None = None, **extra) -> zephon.CheckpointingConfig:
    return zephon.CheckpointingConfig(
        save_dir=str(tmp_path / "save_dir"),
        memory_tier=True,
        memory_dir=str(tmp_path / "shm"),
        local_dir=str(tmp_path / "nvme"),
        catalog_url=catalog_url,
        **extra,
    )


def _train(manager: zephon.CheckpointManager, model: nn.Module, steps) -> None:
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        manager.save(step, {"model": model})
    manager.wait()


def test_memory_tier_and_local_dir_are_accepted_together_but_never_overlapping(tmp_path):
    config = _config(tmp_path)
    assert config.tier is not None and config.tier.memory_tier
    assert config.local_dir == str(tmp_path / "nvme")
    for memory, local in [
        (tmp_path / "same", tmp_path / "same"),
        (tmp_path / "nvme" / "shm", tmp_path / "nvme"),
        (tmp_path / "shm", tmp_path / "shm" / "nvme"),
    ]:
        with pytest.raises(ConfigError) as caught:
            zephon.CheckpointingConfig(
                save_dir=str(tmp_path / "save_dir"),
                memory_tier=True,
                memory_dir=str(memory),
                local_dir=str(local),
            )
        message = str(caught.value)
        assert "trainer.checkpointing.local_dir" in message and "memory_dir" in message
        assert "\n" not in message


def test_a_save_lands_in_memory_then_local_dir_then_save_dir_each_with_its_row(
    tmp_path, catalog_url, cli, monkeypatch
):
    monkeypatch.setattr(render, "console", Console(width=200, highlight=False, soft_wrap=True))
    config = _config(tmp_path, catalog_url)
    model = nn.Linear(4, 2)
    with zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager:
        _train(manager, model, [1])
    for root in ("shm", "nvme", "save_dir"):
        run = CheckpointStore(str(tmp_path / root)).run("tiny")
        assert run.committed_steps() == [1], root
        assert run.verify(1, deep=True).ok, root  # every file against its CRC32C
    local = CheckpointStore(str(tmp_path / "nvme")).run("tiny").read_manifest(1)
    memory = CheckpointStore(str(tmp_path / "shm")).run("tiny").read_manifest(1)
    assert local.save_id == memory.save_id and local.epoch == memory.epoch
    assert {(e.name, e.crc32c) for e in local.files} == {(e.name, e.crc32c) for e in memory.files}
    assert local.metadata == memory.metadata
    with Catalog(catalog_url) as catalog:
        rows = sorted((r.tier, r.state) for r in catalog.replicas("tiny"))
        [copy] = catalog.replicas("tiny", tier="local")
    assert rows == [("local", "committed"), ("memory", "committed"), ("save_dir", "committed")]
    assert copy.bytes == local.total_bytes and copy.location.endswith("tiny/save-1")
    code, out, err = cli("checkpoints", "tiny")
    assert (code, err) == (0, "") and "memory, local, save_dir" in out, out


def test_local_dir_keeps_local_num_to_keep(tmp_path):
    catalog_url = f"sqlite:///{tmp_path}/catalog.db"
    config = _config(tmp_path, catalog_url, local_num_to_keep=2)
    with zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager:
        _train(manager, nn.Linear(4, 2), [1, 2, 3, 4])
    assert CheckpointStore(str(tmp_path / "nvme")).run("tiny").committed_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path / "nvme" / "tiny")) == ["save-3", "save-4"]
    with Catalog(catalog_url) as catalog:
        rows = [(r.step, r.state) for r in catalog.replicas("tiny", tier="local")]
    assert rows == [(1, "deleted"), (2, "deleted"), (3, "committed"), (4, "committed")]


def test_a_failed_local_copy_is_one_warning_and_a_failed_row_and_the_upload_goes_on(
    tmp_path, caplog
):
    catalog_url = f"sqlite:///{tmp_path}/catalog.db"
    config = _config(tmp_path, catalog_url)
    os.makedirs(tmp_path / "nvme" / "tiny")
    (tmp_path / "nvme" / "tiny" / "save-2").write_text("a file where the step's directory goes")
    with (
        caplog.at_level(logging.WARNING, logger="zephon"),
        zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager,
    ):
        _train(manager, nn.Linear(4, 2), [1, 2])
    warnings = [r.getMessage() for r in caplog.records if "local_dir copy" in r.getMessage()]
    assert len(warnings) == 1 and "step 2" in warnings[0], warnings
    assert CheckpointStore(str(tmp_path / "save_dir")).run("tiny").committed_steps() == [1, 2]
    with Catalog(catalog_url) as catalog:
        rows = {r.step: r for r in catalog.replicas("tiny", tier="local")}
    assert rows[2].state == "failed" and rows[2].failure_reason
    assert rows[1].state == "committed"


def _saved_then_memory_lost(
    tmp_path, catalog_url: str
) -> tuple[zephon.CheckpointingConfig, nn.Module]:
    config = _config(tmp_path, catalog_url)
    model = nn.Linear(4, 2)
    with zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager:
        _train(manager, model, [1, 2])
    shutil.rmtree(tmp_path / "shm")  # a reboot: host memory is gone, the local disk is not
    return config, model


def test_a_resume_without_memory_reads_local_dir_and_never_save_dir(tmp_path):
    config, model = _saved_then_memory_lost(tmp_path, f"sqlite:///{tmp_path}/catalog.db")
    strip_tensors(tmp_path / "save_dir", 2, run="tiny")  # a load from save_dir would fail
    fresh = nn.Linear(4, 2)
    with zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager:
        resume = manager.load_latest({"model": fresh})
    assert resume.step == 2 and resume.url.startswith(str(tmp_path / "nvme")), resume.url
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def _flip_a_tensor_byte(root) -> str:
    """Flip a byte in the middle of the largest tensor of step 2 under ``root`` (read by the
    load, CRC-checked); the save's id."""
    run = CheckpointStore(str(root)).run("tiny")
    reader = run.reader(2)
    where = largest_tensor_slice(reader.read_bytes("dcp/dcp_metadata.json"), reader.url)
    path = os.path.join(reader.path, where.file)
    with open(path, "r+b") as damaged:
        damaged.seek(where.offset + where.length // 2)
        byte = damaged.read(1)[0]
        damaged.seek(-1, os.SEEK_CUR)
        damaged.write(bytes([byte ^ 0x01]))
    return run.read_manifest(2).save_id


def test_a_damaged_local_copy_is_condemned_and_save_dir_is_loaded(tmp_path, caplog):
    config, model = _saved_then_memory_lost(tmp_path, f"sqlite:///{tmp_path}/catalog.db")
    local = CheckpointStore(str(tmp_path / "nvme")).run("tiny")
    save_id = _flip_a_tensor_byte(tmp_path / "nvme")
    fresh = nn.Linear(4, 2)
    with (
        caplog.at_level(logging.WARNING, logger="zephon"),
        zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager,
    ):
        resume = manager.load_latest({"model": fresh})
    assert resume.step == 2 and resume.url.startswith(str(tmp_path / "save_dir")), resume.url
    assert torch.equal(fresh.weight, model.weight)
    assert local.is_condemned(2, save_id)  # there only: save_dir's copy is another one
    assert any("damaged" in r.getMessage() for r in caplog.records)


def test_a_damaged_memory_copy_gives_way_to_the_local_copy_not_save_dir(tmp_path, caplog):
    config = _config(tmp_path, f"sqlite:///{tmp_path}/catalog.db")
    model = nn.Linear(4, 2)
    with zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager:
        _train(manager, model, [1, 2])
    _flip_a_tensor_byte(tmp_path / "shm")
    strip_tensors(tmp_path / "save_dir", 2, run="tiny")  # a load from save_dir would fail
    fresh = nn.Linear(4, 2)
    with (
        caplog.at_level(logging.WARNING, logger="zephon"),
        zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager,
    ):
        resume = manager.load_latest({"model": fresh})
    assert resume.step == 2 and resume.url.startswith(str(tmp_path / "nvme")), resume.url
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert any("damaged" in r.getMessage() for r in caplog.records)


def test_the_drop_in_writer_copies_into_local_dir_behind_memory(tmp_path):
    import torch.distributed.checkpoint as dcp

    import zephon.dcp as zd

    memory_dir, local_dir = str(tmp_path / "shm"), str(tmp_path / "nvme")
    writer = zd.Writer(
        f"{tmp_path / 'save_dir'}/run",
        step=5,
        memory_tier=True,
        memory_dir=memory_dir,
        local_dir=local_dir,
    )
    try:
        dcp.save({"w": torch.arange(8.0)}, storage_writer=writer)
        writer.wait_uploads()
    finally:
        writer.close()
    for root in (memory_dir, local_dir, str(tmp_path / "save_dir")):
        run = CheckpointStore(root).run("run")
        assert run.committed_steps() == [5] and run.verify(5, deep=True).ok, root


def test_a_memory_save_the_lineage_no_longer_admits_gives_way_to_the_local_copy(tmp_path):
    """Attempt 1 saves step 2 everywhere, then step 4 in memory and on save_dir but not on
    local disk (its local copy fails). Attempt 2, elsewhere, resumes from step 2 (save_dir's
    step 4 is gone) and ends: attempt 1's step 4 left the run's history. Attempt 3, back on
    the first node, finds step 4 complete in memory and step 2 on local disk: it loads the
    local copy, neither the stale memory save nor save_dir."""
    catalog_url = f"sqlite:///{tmp_path}/catalog.db"
    config = _config(tmp_path, catalog_url)
    model = nn.Linear(4, 2)
    blocker = tmp_path / "nvme" / "tiny" / "save-4"
    with zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager:
        _train(manager, model, [2])
        at_two = {k: v.clone() for k, v in model.state_dict().items()}
        blocker.write_text("a file where the step's directory goes")
        _train(manager, model, [4])
    blocker.unlink()
    assert CheckpointStore(str(tmp_path / "shm")).run("tiny").committed_steps() == [4]
    shutil.rmtree(tmp_path / "save_dir" / "tiny" / "save-4")
    elsewhere = zephon.CheckpointingConfig(
        save_dir=str(tmp_path / "save_dir"),
        memory_tier=True,
        memory_dir=str(tmp_path / "other"),
        catalog_url=catalog_url,
    )
    with zephon.CheckpointManager(elsewhere, run_name="tiny", total_steps=10) as manager:
        assert manager.load_latest({"model": nn.Linear(4, 2)}).step == 2
    strip_tensors(tmp_path / "save_dir", 2, run="tiny")  # a load from save_dir would fail
    fresh = nn.Linear(4, 2)
    with zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager:
        resume = manager.load_latest({"model": fresh})
    assert resume.step == 2 and resume.url.startswith(str(tmp_path / "nvme")), resume.url
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in at_two.items())
