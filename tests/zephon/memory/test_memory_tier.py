"""The memory tier in one process, and its choice of a save from what nodes hold.

The multi-node resumes run as real processes in ``test_memory_resume.py``; here: the config's
one-line errors, the choice of the newest save held in full between nodes (pure), a node's
listing and records on disk, memory bounded by ``memory_num_to_keep``, what an earlier job
left deleted at the resume, and the replica rows.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import zephon
from zephon.catalog import Catalog
from zephon.destinations.memory.choice import choose, sources
from zephon.destinations.memory.records import Holding, scan, write_record
from zephon.errors import ConfigError
from zephon.storage import FileEntry, Manifest


def _entry(name: str, size: int = 4) -> FileEntry:
    return FileEntry(name=name, size=size, crc32c=f"AAAA{name[-1]}A==")


def _marker(step: int, save_id: str, files: list[FileEntry], epoch: int = 1) -> str:
    manifest = Manifest(
        run="r", step=step, save_id=save_id, files=tuple(files), epoch=epoch, payload=save_id
    )
    return manifest.to_json().decode()


def _record(rank: int, world: int, step: int, save_id: str, files: list[FileEntry]) -> dict:
    return {
        "rank": rank,
        "world_size": world,
        "step": step,
        "save_id": save_id,
        "files": [e.to_dict() for e in files],
    }


def _two_nodes(step: int = 4, save_id: str = "e1-a") -> tuple[Holding, Holding]:
    """Rank 0 on node 0, rank 1 on node 1; each node holds its part and the other's copy."""
    zero, one = [_entry("dcp/__0_0.distcp"), _entry("zephon.json")], [_entry("dcp/__1_0.distcp")]
    held = {e.name: e.size for e in zero + one}
    node0 = Holding(step, save_id, {0: _record(0, 2, step, save_id, [])}, dict(held))
    node0.marker = _marker(step, save_id, zero)
    node0.records[1] = _record(1, 2, step, save_id, one)
    node1 = Holding(step, save_id, dict(node0.records), dict(held), node0.marker)
    return node0, node1


def test_the_newest_save_held_in_full_between_the_nodes_is_chosen():
    node0, node1 = _two_nodes()
    chosen = choose([[node0], [node1]])
    assert chosen is not None and (chosen.step, chosen.save_id, chosen.world_size) == (
        4,
        "e1-a",
        2,
    )
    assert chosen.held_by(0) and chosen.held_by(1)
    assert sorted(chosen.files) == ["dcp/__0_0.distcp", "dcp/__1_0.distcp", "zephon.json"]


def test_a_lost_nodes_part_comes_from_the_peer_that_holds_it():
    node0, _ = _two_nodes()
    chosen = choose([[node0], []])  # node 1 replaced: its memory is empty
    assert chosen is not None and not chosen.held_by(1)
    assert set(sources(chosen, 1, 2).values()) == {0}
    assert set(sources(chosen, 0, 2).values()) == {0}


@pytest.mark.parametrize(
    "damage",
    ["no marker", "a rank's record", "a file", "a file's size", "rank 0's record"],
)
def test_a_save_missing_anything_is_not_chosen_and_the_older_complete_one_is(damage):
    old0, old1 = _two_nodes(step=2, save_id="e1-old")
    new0, new1 = _two_nodes(step=4, save_id="e1-new")
    for node in (new0, new1):
        if damage == "no marker":
            node.marker = None
        elif damage == "a rank's record":
            node.records.pop(1)
        elif damage == "a file":
            node.files.pop("dcp/__1_0.distcp")
        elif damage == "a file's size":
            node.files["zephon.json"] = 3
        else:
            node.records.pop(0)
    chosen = choose([[new0, old0], [new1, old1]])
    assert chosen is not None and chosen.step == 2


def test_two_ranks_reporting_one_file_differently_is_not_a_save_to_load():
    node0, node1 = _two_nodes()
    for node in (node0, node1):
        node.records[1] = _record(1, 2, 4, "e1-a", [_entry("zephon.json", size=9)])
    assert choose([[node0], [node1]]) is None


def test_a_nodes_listing_reads_records_and_the_marker_and_ignores_garbage(tmp_path):
    payload = tmp_path / "r" / "save-3" / "e1-x"
    (payload / "dcp").mkdir(parents=True)
    (payload / "dcp" / "__1_0.distcp").write_bytes(b"12345")
    write_record(str(payload), rank=1, world_size=2, step=3, save_id="e1-x", files=[])
    (payload / "_zephon_memory" / "rank-7.json").write_text("{not json")
    (payload / "_zephon_memory" / "rank-8.json").write_text(json.dumps({"rank": 8}))
    (tmp_path / "r" / "save-3" / "_COMMIT").write_text(_marker(3, "e1-x", []))
    (tmp_path / "r" / "save-x").mkdir()
    [holding] = scan(str(tmp_path / "r"))
    assert (holding.step, holding.save_id) == (3, "e1-x")
    assert holding.files == {"dcp/__1_0.distcp": 5}
    assert sorted(holding.records) == [1] and holding.marker is not None
    assert Holding.from_dict(json.loads(json.dumps(holding.to_dict()))) == holding


def test_memory_tier_options_are_checked_in_one_line(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    for options, key in [
        ({"memory_replicas": 0}, "memory_replicas"),
        ({"memory_num_to_keep": 0}, "memory_num_to_keep"),
        ({"memory_dir": "s3://b/x"}, "memory_dir"),
        ({"memory_dir": save_dir}, "memory_dir"),
        ({"memory_tier": "yes"}, "memory_tier"),
        ({"memory_dir": str(tmp_path / "nvme"), "local_dir": str(tmp_path / "nvme")}, "local_dir"),
    ]:
        with pytest.raises(ConfigError) as caught:
            zephon.CheckpointingConfig(save_dir=save_dir, **{"memory_tier": True, **options})
        message = str(caught.value)
        assert f"trainer.checkpointing.{key}" in message and "\n" not in message
    config = zephon.CheckpointingConfig(save_dir=save_dir, memory_tier=True)
    assert config.memory_dir == "/dev/shm/zephon" and config.tier is not None


def _steps(memory_dir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(memory_dir, "tiny")))


def test_memory_keeps_memory_num_to_keep_and_a_resume_clears_what_an_earlier_job_left(tmp_path):
    config = zephon.CheckpointingConfig(
        save_dir=str(tmp_path / "shared"),
        memory_tier=True,
        memory_dir=str(tmp_path / "shm"),
        memory_num_to_keep=2,
        catalog_url=f"sqlite:///{tmp_path}/catalog.db",
    )
    model = nn.Linear(4, 2)
    with zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            manager.save(step, {"model": model})
        manager.wait()
        assert _steps(config.memory_dir) == ["save-2", "save-3"]
    # what an earlier job left, never loaded again: gone once the next job resumed
    os.makedirs(os.path.join(config.memory_dir, "tiny", "save-9", "e9-junk"))
    fresh = nn.Linear(4, 2)
    with zephon.CheckpointManager(config, run_name="tiny", total_steps=10) as manager:
        resume = manager.load_latest({"model": fresh})
        assert _steps(config.memory_dir) == ["save-3"]
    assert resume.step == 3 and "/.resume/" in resume.url
    assert torch.equal(fresh.weight, model.weight)
    with Catalog(config.catalog_url) as catalog:
        rows = [(r.step, r.tier, r.state) for r in catalog.replicas("tiny", tier="memory")]
    assert rows == [(1, "memory", "deleted"), (2, "memory", "deleted"), (3, "memory", "committed")]


def test_the_drop_in_writer_saves_into_memory_and_uploads(tmp_path):
    import torch.distributed.checkpoint as dcp

    import zephon.dcp as zd
    from zephon.storage import CheckpointStore

    memory_dir, save_dir = str(tmp_path / "shm"), str(tmp_path / "shared")
    state = {"w": torch.arange(8.0)}
    writer = zd.Writer(f"{save_dir}/run", step=5, memory_tier=True, memory_dir=memory_dir)
    try:
        dcp.save(state, storage_writer=writer)
        writer.wait_uploads()
    finally:
        writer.close()
    assert CheckpointStore(memory_dir).run("run").committed_steps() == [5]
    assert CheckpointStore(save_dir).run("run").committed_steps() == [5]
    with pytest.raises(ConfigError, match="Writer.memory_replicas"):
        zd.Writer(f"{save_dir}/run", step=6, memory_tier=True, memory_replicas=9)
