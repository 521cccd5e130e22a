"""Deduplicated saves through the local and memory tiers (``dedup`` with ``local_dir`` or
``memory_tier``; docs/dedup.md, "Layout"): a save commits into the tier as plain files, its
upload stores the shards in save_dir as chunks against save_dir's newest checkpoint, and every
save loads bit for bit from save_dir once the tier is gone."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import zephon.dcp as zd
from tests.conftest import make_backend
from tests.zephon.dedup.test_manager_dedup import MIB, Adapted, stored_bytes
from zephon.checkpointing import CheckpointManager, export_safetensors
from zephon.config import CheckpointingConfig
from zephon.destinations.local.dedup import DIRECT_BYTES, GATHER_BYTES, DedupPlan, pieces_of
from zephon.errors import ConfigError
from zephon.storage import CheckpointStore, FileEntry
from zephon.storage.chunks import DEFAULT_MAX_CHUNK

RUN = "r"
SAVES = 5


@pytest.fixture
def s3_backend(request, tmp_path):
    return make_backend("s3", request, tmp_path)


def tier_options(kind: str, tmp_path) -> dict:
    options: dict = {}
    if "local" in kind:
        options["local_dir"] = str(tmp_path / "nvme")
    if "memory" in kind:
        options.update(memory_tier=True, memory_dir=str(tmp_path / "shm"))
    return options


def tier_dirs(kind: str, tmp_path) -> list[str]:
    return [
        str(tmp_path / name) for key, name in (("memory", "shm"), ("local", "nvme")) if key in kind
    ]


def save_steps(config, steps, model, optimizer, saved) -> None:
    with CheckpointManager(config, run_name=RUN, total_steps=100) as manager:
        manager.load_latest({"model": model, "optimizer": optimizer})
        for step in steps:
            model.step(optimizer)
            manager.save(step, {"model": model, "optimizer": optimizer})
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        manager.wait()


@pytest.mark.parametrize("kind", ["local", "memory", "memory+local"])
def test_a_tier_uploads_only_what_changed_and_every_save_loads_from_save_dir(
    kind, s3_backend, tmp_path
):
    model = Adapted()
    optimizer = torch.optim.Adam([model.adapter.weight], lr=0.1)
    config = CheckpointingConfig(
        save_dir=s3_backend.url,
        storage_options=s3_backend.storage_options,
        period_steps=1,
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        dedup=True,
        **tier_options(kind, tmp_path),
    )
    saved: dict[int, dict[str, torch.Tensor]] = {}
    save_steps(config, range(1, SAVES + 1), model, optimizer, saved)

    store = CheckpointStore(s3_backend.url, s3_backend.storage_options)
    run = store.run(RUN)
    base_bytes = model.base.weight.numel() * 4
    changed = model.adapter.weight.numel() * 4 * 3  # the adapter and Adam's two moments
    manifests = {m.step: m for m in run.complete()}
    assert sorted(manifests) == list(range(1, SAVES + 1))
    # in save_dir: the base once, then each save's changed bytes and small files
    total = stored_bytes(store, RUN)
    assert base_bytes < total < base_bytes + SAVES * (changed + 4 * DIRECT_BYTES)
    assert manifests[1].new_bytes >= base_bytes
    for step in range(2, SAVES + 1):
        manifest = manifests[step]
        assert manifest.chunked and manifest.total_bytes > base_bytes
        assert manifest.new_bytes < changed + 4 * DIRECT_BYTES, step
        # the base's chunks are listed, not uploaded again: the first save's instance
        owners = {c.save_id for c in manifest.chunk_refs() if c.size >= base_bytes // 4}
        assert owners == {manifests[1].save_id}, step
    # the tiers' own copies are plain files: no chunk there, no chunk listed
    for where in tier_dirs(kind, tmp_path):
        run_there = CheckpointStore(where).run(RUN)
        held = [run_there.read_manifest(step) for step in run_there.committed_steps()]
        assert held and not any(manifest.chunked for manifest in held), where
        assert not os.path.exists(os.path.join(where, RUN, "_chunks"))

    # the tiers are gone: every save loads bit for bit from save_dir alone
    for where in tier_dirs(kind, tmp_path):
        shutil.rmtree(where)
    for step in range(1, SAVES + 1):
        run.verify(step, deep=True).raise_for_problems()
        out = tmp_path / f"export-{step}"
        export_safetensors(store, RUN, step, str(out))
        exported = load_file(str(out / "model.safetensors"))
        for key, value in saved[step].items():
            assert torch.equal(exported[key], value), (step, key)
    fresh = Adapted(seed=1)
    fresh_optimizer = torch.optim.Adam([fresh.adapter.weight], lr=0.1)
    # a new job resumes from save_dir and its first upload's base is save_dir's latest
    save_steps(config, [SAVES + 1], fresh, fresh_optimizer, saved)
    for key, value in saved[SAVES].items():
        if key.startswith("base"):
            assert torch.equal(fresh.state_dict()[key], value), key
    newest = run.read_manifest(SAVES + 1)
    assert newest.chunked and newest.new_bytes < changed + 4 * DIRECT_BYTES
    store.close()


def test_retention_after_tier_uploads_keeps_exactly_the_chunks_referenced(s3_backend, tmp_path):
    model = Adapted(base_mib=1)
    optimizer = torch.optim.Adam([model.adapter.weight], lr=0.1)
    config = CheckpointingConfig(
        save_dir=s3_backend.url,
        storage_options=s3_backend.storage_options,
        period_steps=1,
        num_to_keep=2,
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        dedup=True,
        local_dir=str(tmp_path / "nvme"),
    )
    save_steps(config, range(1, 7), model, optimizer, {})
    store = CheckpointStore(s3_backend.url, s3_backend.storage_options)
    run = store.run(RUN)
    assert run.committed_steps() == [5, 6]
    referenced = {c.name for m in run.complete() for c in m.chunk_refs()}
    present = {
        f.path.rsplit("/", 1)[-1] for f in store.location.backend.list_files(run.layout.chunk_dir)
    }
    # the first save's chunks (the base every later one lists) outlived its checkpoint
    assert referenced and present == referenced
    shutil.rmtree(tmp_path / "nvme")
    for step in (5, 6):
        run.verify(step, deep=True).raise_for_problems()
    store.close()


def test_the_drop_in_writer_with_a_local_dir_uploads_chunks(s3_backend, tmp_path):
    run_url = f"{s3_backend.url}/lora"
    frozen = torch.randn(1024, 1024)  # 4 MiB that never change
    frozen_after = torch.randn(256, 700)  # 700 KiB that never change either

    def state_at(step: int) -> dict[str, torch.Tensor]:
        # one shard file, in this order: the changed tensor between two frozen ones, so a cut
        # on a grid would upload the frozen bytes around it again every save
        adapter = torch.full((64, 1024), float(step))  # 256 KiB that change every save
        return {"frozen": frozen, "adapter": adapter, "frozen_after": frozen_after}

    writer = zd.Writer(
        run_url,
        storage_options=s3_backend.storage_options,
        local_dir=str(tmp_path / "nvme"),
        dedup=True,
        thread_count=1,
    )
    try:
        for step in (1, 2, 3):
            dcp.save(state_at(step), storage_writer=writer, checkpoint_id=f"{run_url}/save-{step}")
        writer.wait_uploads()
    finally:
        writer.close()
    local = CheckpointStore(str(tmp_path / "nvme")).run("lora")
    assert local.committed_steps() == [1, 2, 3]
    assert not any(local.read_manifest(step).chunked for step in (1, 2, 3))
    shutil.rmtree(tmp_path / "nvme")
    store = CheckpointStore(s3_backend.url, s3_backend.storage_options)
    manifests = {m.step: m for m in store.run("lora").complete()}
    assert manifests[1].new_bytes >= 4 * MIB
    changed = 256 << 10
    for step in (2, 3):
        assert manifests[step].chunked
        assert changed <= manifests[step].new_bytes < changed + DIRECT_BYTES, step
    for step in (1, 2, 3):
        state = {k: torch.zeros_like(v) for k, v in state_at(step).items()}
        reader = zd.Reader(run_url, storage_options=s3_backend.storage_options, step=step)
        dcp.load(state, storage_reader=reader)
        for key, value in state_at(step).items():
            assert torch.equal(state[key], value), (step, key)
    store.close()


def test_dedup_with_a_tier_is_accepted_and_checked_in_one_line(tmp_path):
    config = CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"), dedup=True, local_dir=str(tmp_path / "nvme")
    )
    assert config.tier is not None and config.tier.dedup is True
    config = CheckpointingConfig(save_dir=str(tmp_path / "ckpt"), dedup=True, memory_tier=True)
    assert config.tier is not None and config.tier.dedup is True
    with pytest.raises(ConfigError, match="Writer.dedup"):
        zd.Writer(f"{tmp_path}/ckpt/run", local_dir=str(tmp_path / "nvme"), dedup="yes")


def test_a_shard_is_cut_as_the_direct_save_cuts_it():
    big, small = 3 * DEFAULT_MAX_CHUNK + 5, DIRECT_BYTES // 2
    # header, a large tensor, three small ones with their headers, the end of the file
    slices = [(100, big), (100 + big + 50, small), (100 + big + 50 + small + 50, small)]
    size = 100 + big + 50 + small + 50 + small + 30
    pieces = pieces_of(size, slices)
    assert sum(pieces) == size
    # the large tensor alone, in 8 MiB pieces; the rest gathered around it
    assert pieces == [
        100,
        DEFAULT_MAX_CHUNK,
        DEFAULT_MAX_CHUNK,
        DEFAULT_MAX_CHUNK,
        5,
        size - 100 - big,
    ]
    many = [(i * 1000, 1000) for i in range(3000)]
    gathered = pieces_of(3_000_000, many)
    assert sum(gathered) == 3_000_000 and max(gathered) <= GATHER_BYTES and len(gathered) == 3


# -- two ranks (tests/zephon/tier/tier_worker.py): every rank's shards reach save_dir as chunks


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["shared", "per-node"])
def test_every_ranks_shards_are_uploaded_as_chunks_and_load_from_fresh_local_dirs(
    monkeypatch, s3_backend, tmp_path, layout
):
    from tests.ranks import launch, store_config

    local_dir = tmp_path / ("local" if layout == "shared" else "node{rank}")
    config = {
        "run": "ranks",
        "catalog_url": f"sqlite:///{tmp_path / 'catalog.db'}",
        "local_dir": str(local_dir),
        "dedup": True,
    }
    script = [["save", 1, "a"], ["wait"], ["save", 2, "a"], ["wait"]]
    script += [["reopen", str(tmp_path / "fresh{rank}")], ["load", "a"]]
    monkeypatch.setenv("ZEPHON_TIER_TEST", json.dumps({**config, "script": script}))
    ranks = launch("tests.zephon.tier.tier_worker", 2, store_config(s3_backend))
    for record in ranks:
        assert not [a for a in record["actions"] if "error" in a], record
        loads = [a["ok"] for a in record["actions"] if a["action"][0] == "load"]
        assert [got["step"] for got in loads] == [2] and loads[0]["differing"] == [], loads
    store = s3_backend.open_store()
    run = store.run("ranks")
    assert run.committed_steps() == [1, 2]
    for step in (1, 2):
        manifest = run.read_manifest(step)
        shards = [e for e in manifest.files if e.name.endswith(".distcp")]
        # each rank's shards, stored as chunks and listed by rank 0's commit
        assert {e.name.split("/")[1].split("_")[2] for e in shards} == {"0", "1"}
        assert shards and all(e.chunks for e in shards), manifest.files
        run.verify(step, deep=True).raise_for_problems()
    store.close()


def test_only_shard_files_are_chunked_and_one_the_metadata_does_not_describe_on_a_grid():
    size = 3 * GATHER_BYTES + 1
    plan = DedupPlan(pieces={"dcp/__1_0.distcp": (size - 10, 10)})
    assert plan.cut(FileEntry("dcp/__1_0.distcp", size, "AAAAAA==")) == [size - 10, 10]
    grid = [GATHER_BYTES] * 3 + [1]
    assert plan.cut(FileEntry("dcp/__0_0.distcp", size, "AAAAAA==")) == grid
    # pieces that do not add up to the file's size are not trusted
    assert plan.cut(FileEntry("dcp/__1_0.distcp", size + 1, "AAAAAA==")) == grid[:-1] + [2]
    for plain in ("ranks/0.json", "zephon.json", "dcp/.metadata", "dcp/__x_0.distcp"):
        assert plan.cut(FileEntry(plain, size, "AAAAAA==")) is None, plain
