"""Deduplicated saves through the checkpoint manager (``dedup: true``, docs/dedup.md): what is
stored, what is loaded, what retention and gc remove, on local disk and on object stores."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.conftest import make_backend
from zephon.checkpointing import CheckpointManager, export_safetensors
from zephon.config import CheckpointingConfig, load_job_config
from zephon.errors import ConfigError
from zephon.storage import CheckpointStore

MIB = 1 << 20


class Adapted(nn.Module):
    """A frozen base and a small trained adapter: most bytes never change between saves."""

    def __init__(self, base_mib: float = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        side = int((base_mib * MIB / 4) ** 0.5)
        self.base = nn.Linear(side, side, bias=False)
        self.base.weight.requires_grad_(False)
        self.adapter = nn.Linear(side, 8, bias=False)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        x = torch.ones(2, self.base.in_features)
        self.adapter(self.base(x)).pow(2).mean().backward()
        optimizer.step()


def stored_bytes(store: CheckpointStore, run: str) -> int:
    location = store.location
    root = store.run(run).run_path()
    return sum(f.size for f in location.backend.list_files(root))


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path):
    return make_backend(request.param, request, tmp_path)


def config_for(backend, tmp_path, **extra) -> CheckpointingConfig:
    return CheckpointingConfig(
        save_dir=backend.url,
        storage_options=backend.storage_options,
        period_steps=1,
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        dedup=True,
        **extra,
    )


def test_unchanged_bytes_are_stored_once_and_every_save_loads_exactly(backend, tmp_path):
    model = Adapted()
    optimizer = torch.optim.Adam([model.adapter.weight], lr=0.1)
    config = config_for(backend, tmp_path)
    saved = {}
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        manager.load_latest({"model": model, "optimizer": optimizer})
        for step in range(1, 6):
            model.step(optimizer)
            manager.save(step, {"model": model, "optimizer": optimizer})
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        store = manager.store
        base_bytes = model.base.weight.numel() * 4
        total = stored_bytes(store, "r")
        # the base once, plus each save's changed bytes and small files
        assert base_bytes < total < base_bytes * 1.5
        manifests = {m.step: m for m in store.run("r").complete()}
        assert manifests[1].new_bytes >= base_bytes
        assert all(manifests[s].new_bytes < base_bytes / 4 for s in range(2, 6))
        assert all(manifests[s].total_bytes > base_bytes for s in range(1, 6))
        for step in range(1, 6):
            store.run("r").verify(step, deep=True).raise_for_problems()
    fresh = Adapted(seed=1)
    fresh_optimizer = torch.optim.Adam([fresh.adapter.weight], lr=0.1)
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        assert manager.load_latest({"model": fresh, "optimizer": fresh_optimizer}).step == 5
        export_safetensors(manager.store, "r", 2, str(tmp_path / "two"))
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[5][key]), key
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 5
    exported = load_file(str(tmp_path / "two" / "model.safetensors"))
    for key, value in saved[2].items():
        assert torch.equal(exported[key], value), key


def test_retention_removes_the_chunks_no_kept_checkpoint_needs(backend, tmp_path):
    model = Adapted(base_mib=1)
    optimizer = torch.optim.Adam([model.adapter.weight], lr=0.1)
    config = config_for(backend, tmp_path, num_to_keep=2)
    with CheckpointManager(config, run_name="r", total_steps=6) as manager:
        manager.load_latest({"model": model, "optimizer": optimizer})
        for step in range(1, 7):
            model.step(optimizer)
            manager.save(step, {"model": model, "optimizer": optimizer})
        run = manager.store.run("r")
        assert run.committed_steps() == [5, 6]
        referenced = {c.name for m in run.complete() for c in m.chunk_refs()}
        chunk_dir = run.layout.chunk_dir
        present = {
            f.path.rsplit("/", 1)[-1] for f in manager.store.location.backend.list_files(chunk_dir)
        }
        assert present == referenced  # nothing kept that no checkpoint references
        for step in (5, 6):
            run.verify(step, deep=True).raise_for_problems()


def test_a_missing_chunk_is_damage_that_verify_names(tmp_path):
    config = CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"), period_steps=1, dedup=True, catalog_url=None
    )
    model = Adapted(base_mib=1)
    with CheckpointManager(config, run_name="r", total_steps=1) as manager:
        manager.save(1, {"model": model})
        run = manager.store.run("r")
        chunk = run.read_manifest(1).chunk_refs()[0]
        os.remove(os.path.join(tmp_path, "ckpt", "r", "_chunks", chunk.name))
        report = run.verify(1)
        assert not report.ok
        assert chunk.name in str(report.problems[0])


def test_export_to_safetensors_reads_a_deduplicated_save(tmp_path):
    config = CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"), period_steps=1, dedup=True, catalog_url=None
    )
    model = Adapted(base_mib=1)
    with CheckpointManager(config, run_name="r", total_steps=2) as manager:
        manager.save(1, {"model": model})
        manager.save(2, {"model": model})
        export_safetensors(manager.store, "r", 2, str(tmp_path / "out"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    for key, value in model.state_dict().items():
        assert torch.equal(exported[key], value), key


def test_dedup_is_a_yaml_key_checked_as_a_bool(tmp_path):
    job = load_job_config(
        {
            "run": {"name": "r"},
            "trainer": {
                "checkpointing": {"save_dir": str(tmp_path), "dedup": True},
            },
        }
    )
    assert job.checkpointing.dedup is True
    with pytest.raises(ConfigError, match="dedup"):
        CheckpointingConfig(save_dir=str(tmp_path), dedup="yes")


def test_the_catalog_and_zephon_checkpoints_show_what_each_save_added(tmp_path, catalog_url, cli):
    config = CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"), period_steps=1, dedup=True, catalog_url=catalog_url
    )
    model = Adapted(base_mib=2)
    optimizer = torch.optim.Adam([model.adapter.weight], lr=0.1)
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        for step in (1, 2):
            model.step(optimizer)
            manager.save(step, {"model": model, "optimizer": optimizer})
    code, out, _ = cli("checkpoints", "r", "--json")
    assert code == 0
    rows = {row["step"]: row for row in json.loads(out)}
    assert rows[1]["stored_bytes"] == rows[1]["bytes"]  # the first save stored everything
    assert rows[2]["stored_bytes"] < rows[2]["bytes"] / 10
    code, out, _ = cli("checkpoints", "r", "--wide")
    header = next(line for line in out.splitlines() if line.lstrip().startswith("step"))
    assert header.split()[:5] == ["step", "state", "epoch", "size", "new"]
    assert "2.0 MiB" in out or "2.1 MiB" in out
