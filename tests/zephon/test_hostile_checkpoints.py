"""Checkpoints are input: a marker, DCP metadata or JSON state written by someone hostile (or
damaged) is refused as corrupt by the manager even with ``verify_on_load=False``, never read
outside its checkpoint, never turned into arbitrary torch attributes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.zephon.test_manager import Counter, build, state_of, train
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig
from zephon.state_tree import join_state
from zephon.storage import CorruptCheckpointError, create_exclusive
from zephon.storage.checksum import crc32c_of


@pytest.fixture
def config(tmp_path) -> CheckpointingConfig:
    return CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        period_steps=3,
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        verify_on_load=False,
        on_corrupt="fail",
    )


def saved(config, steps=3):
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        train(manager, *build(), Counter(), 1, steps)
        return manager.store


def rewrite_marker(store, step, change) -> None:
    """Replace the step's marker with ``change(manifest_json)``, as a writer that skipped
    every check could."""
    marker = f"{store.run('r').checkpoint_path(step)}/_COMMIT"
    body = change(json.loads(store.location.fs.cat_file(marker)))
    os.remove(marker)
    create_exclusive(store.location, marker, json.dumps(body).encode())


@pytest.mark.parametrize("name", ["__builtins__", "load", "nn", "float32.__class__", 7, None])
def test_a_dtype_the_state_names_must_be_a_real_dtype(name):
    with pytest.raises(CorruptCheckpointError, match="unknown dtype"):
        join_state({"__dtype__": name}, {})
    assert join_state({"__dtype__": "bfloat16"}, {}) is torch.bfloat16


def test_a_hostile_dtype_in_a_checkpoints_json_is_refused_on_load(config):
    store = saved(config)
    reader = store.run("r").reader(3)
    path = f"{reader.path}/ranks/0.json"
    with open(path) as handle:
        state = json.load(handle)
    state["state"]["notes"]["value"] = {"__dtype__": "load"}
    with open(path, "w") as handle:
        json.dump(state, handle)
    with (
        CheckpointManager(config, run_name="r", total_steps=10) as manager,
        pytest.raises(CorruptCheckpointError, match="unknown dtype 'load'"),
    ):
        manager.load_latest(state_of(*build(), Counter()))


def test_a_marker_naming_a_file_outside_its_checkpoint_is_refused_on_load(config, tmp_path):
    (tmp_path / "victim.bin").write_bytes(b"\x00" * 64)
    store = saved(config)

    def escape(body):
        body["files"][0]["name"] = "../../../../victim.bin"
        return body

    rewrite_marker(store, 3, escape)
    with (
        CheckpointManager(config, run_name="r", total_steps=10) as manager,
        pytest.raises(CorruptCheckpointError, match="save-3 is damaged .*not a plain relative"),
    ):
        manager.load_latest(state_of(*build(), Counter()))


def test_dcp_metadata_naming_a_file_the_marker_does_not_list_is_refused(config, tmp_path):
    (tmp_path / "victim.bin").write_bytes(b"\x00" * 4096)
    store = saved(config)
    reader = store.run("r").reader(3)
    path = f"{reader.path}/dcp/dcp_metadata.json"
    with open(path) as handle:
        text = handle.read()
    shard = next(n for n in reader.names if n.endswith(".distcp")).removeprefix("dcp/")
    hostile = text.replace(shard, "../../../../victim.bin").encode()
    with open(path, "wb") as handle:
        handle.write(hostile)

    def describe_it(body):  # and a marker that vouches for the edited metadata file
        for entry in body["files"]:
            if entry["name"] == "dcp/dcp_metadata.json":
                entry["size"], entry["crc32c"] = len(hostile), crc32c_of(hostile)
        body["total_bytes"] = sum(e["size"] for e in body["files"])
        return body

    rewrite_marker(store, 3, describe_it)
    with (
        CheckpointManager(config, run_name="r", total_steps=10) as manager,
        pytest.raises(CorruptCheckpointError, match="not listed by the commit marker"),
    ):
        manager.load_latest(state_of(*build(), Counter()))


def test_with_fallback_a_hostile_checkpoint_is_quarantined_and_the_previous_one_loaded(config):
    config.on_corrupt = "fallback"
    store = saved(config, steps=6)

    def escape(body):
        body["files"][0]["name"] = "/etc/passwd"
        return body

    rewrite_marker(store, 6, escape)
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        resume = manager.load_latest(state_of(*build(), Counter()))
        assert resume.step == 3
        assert manager.catalog.get_checkpoint("r", 6).state == "corrupt"


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("zephon.json", lambda doc: {k: v for k, v in doc.items() if k != "entries"}),
        ("zephon.json", lambda doc: [doc]),
        ("ranks/0.json", lambda doc: {**doc, "state": "not an object"}),
    ],
    ids=["meta-without-entries", "meta-not-an-object", "rank-state-not-an-object"],
)
def test_a_json_document_not_shaped_as_zephon_writes_it_is_refused_as_corrupt(config, name, change):
    store = saved(config)
    path = f"{store.run('r').reader(3).path}/{name}"
    with open(path) as handle:
        document = json.load(handle)
    with open(path, "w") as handle:
        json.dump(change(document), handle)
    with (
        CheckpointManager(config, run_name="r", total_steps=10) as manager,
        pytest.raises(CorruptCheckpointError, match=f"{name} is not a Zephon checkpoint document"),
    ):
        manager.load_latest(state_of(*build(), Counter()))


def test_with_fallback_a_zephon_json_not_shaped_as_zephon_writes_it_is_set_aside(config):
    config.on_corrupt = "fallback"
    store = saved(config, steps=6)
    path = f"{store.run('r').reader(6).path}/zephon.json"
    with open(path, "w") as handle:
        json.dump({"format_version": 1}, handle)
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        assert manager.load_latest(state_of(*build(), Counter())).step == 3
        assert manager.catalog.get_checkpoint("r", 6).state == "corrupt"


DEEP = 5000  # far past Python's recursion limit


def deeply_nested(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def replace_file(store, step: int, name: str, data: bytes) -> None:
    """Replace one file of the step, with a marker that vouches for the new bytes."""
    with open(f"{store.run('r').reader(step).path}/{name}", "wb") as handle:
        handle.write(data)

    def describe_it(body):
        for entry in body["files"]:
            if entry["name"] == name:
                entry["size"], entry["crc32c"] = len(data), crc32c_of(data)
        body["total_bytes"] = sum(e["size"] for e in body["files"])
        return body

    rewrite_marker(store, step, describe_it)


def test_a_5000_deep_lightning_json_is_corrupt_in_one_line(tmp_path):
    from zephon.integrations.lightning import LATEST, ZephonCheckpointIO

    io = ZephonCheckpointIO(str(tmp_path / "ckpt"), "r", num_to_keep=None)
    io.save_checkpoint({"global_step": 3, "epoch": 0, "state_dict": {"w": torch.ones(2)}}, "a")
    document = '{"format_version": 1, "state": ' + deeply_nested() + "}"
    replace_file(io.store, 3, "lightning.json", document.encode())
    with pytest.raises(CorruptCheckpointError) as caught:
        io.load_checkpoint(LATEST)
    message = str(caught.value)
    assert "lightning.json is damaged (nested deeper than 100 levels)" in message
    assert "\n" not in message and len(message) < 400


@pytest.mark.parametrize("name", ["zephon.json", "ranks/0.json"])
def test_a_5000_deep_state_document_is_refused_as_corrupt(config, name):
    store = saved(config)
    replace_file(store, 3, name, ('{"state": ' + deeply_nested() + "}").encode())
    with (
        CheckpointManager(config, run_name="r", total_steps=10) as manager,
        pytest.raises(CorruptCheckpointError, match=f"{name} is damaged .nested deeper than"),
    ):
        manager.load_latest(state_of(*build(), Counter()))


def test_a_5000_deep_commit_marker_is_refused_as_corrupt(config):
    store = saved(config)
    marker = f"{store.run('r').checkpoint_path(3)}/_COMMIT"
    os.remove(marker)
    create_exclusive(store.location, marker, deeply_nested().encode())
    with pytest.raises(CorruptCheckpointError, match="nested deeper than 100 levels"):
        store.run("r").read_manifest(3)
