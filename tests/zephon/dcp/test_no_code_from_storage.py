"""No code runs from storage: a checkpoint written by someone hostile, loaded through the
drop-in ``zd.Reader`` with torch's own ``DefaultLoadPlanner`` (which unpickles non-tensor items
with ``weights_only=False``), is refused before any of its pickle runs."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from zephon import dcp as zd
from zephon.storage import crc32c_of, create_exclusive


class Planted:
    """Pickles as a call that creates a file: what a hostile writer stores as an item."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def saved(tmp_path, state) -> tuple[str, object]:
    """``state`` saved as step 1 of run ``r`` with the drop-in Writer; its URL and store."""
    url = f"{tmp_path}/ckpt/r"
    writer = zd.Writer(url, step=1)
    dcp.save(state, storage_writer=writer)
    writer.close()
    return url, writer.store


def rewrite_metadata(store, change) -> None:
    """Replace dcp_metadata.json with ``change(body)`` and re-commit the marker with the new
    file's size and CRC32C, as a hostile writer of the bucket can."""
    reader = store.run("r").reader(1)
    path = reader.local_path("dcp_metadata.json")
    with open(path) as handle:
        data = json.dumps(change(json.load(handle))).encode()
    with open(path, "wb") as handle:
        handle.write(data)
    marker = f"{store.run('r').checkpoint_path(1)}/_COMMIT"
    body = json.loads(store.location.fs.cat_file(marker))
    for entry in body["files"]:
        if entry["name"] == "dcp_metadata.json":
            entry["size"], entry["crc32c"] = len(data), crc32c_of(data)
    body["total_bytes"] = sum(entry["size"] for entry in body["files"])
    os.remove(marker)
    create_exclusive(store.location, marker, json.dumps(body).encode())


def refusal(url, state) -> BaseException:
    """The error a stock ``dcp.load`` through ``zd.Reader`` raises for ``state``."""
    with pytest.raises(CheckpointException) as caught:
        dcp.load(state, storage_reader=zd.Reader(url))
    return zd.as_zephon_error(caught.value, where=url)


def test_a_malicious_pickle_in_a_bytes_item_is_refused_with_torchs_default_planner(tmp_path):
    victim = tmp_path / "pwned"
    url, _ = saved(tmp_path, {"w": torch.ones(3), "blob": Planted(str(victim))})
    error = refusal(url, {"w": torch.zeros(3), "blob": None})
    assert isinstance(error, zd.UnsafeItemError) and error.key == "blob", error
    assert "restricted unpickler" in str(error) and "add_safe_globals" in str(error)
    assert not victim.exists()


def test_a_tensor_entry_relabelled_as_bytes_is_refused(tmp_path):
    """The metadata turns tensor ``w`` into a non-tensor item whose bytes are the planted
    pickle: refused for what it claims to be, before anything is unpickled."""
    victim = tmp_path / "pwned"
    url, store = saved(tmp_path, {"w": torch.ones(3), "blob": Planted(str(victim))})

    def relabel(body):
        body["state_dict_metadata"]["w"] = {"kind": "bytes"}
        blob = next(e for e in body["storage_data"] if e["fqn"] == "blob")
        body["storage_data"] = [e for e in body["storage_data"] if e["fqn"] != "w"]
        body["storage_data"].append({**blob, "fqn": "w"})
        return body

    rewrite_metadata(store, relabel)
    error = refusal(url, {"w": torch.zeros(3)})
    assert isinstance(error, zd.UnsafeItemError) and error.key == "w", error
    assert "is a tensor here" in str(error)
    assert not victim.exists()


def test_a_tensor_slice_relabelled_as_bytes_in_storage_data_only_is_refused(tmp_path):
    victim = tmp_path / "pwned"
    url, store = saved(tmp_path, {"w": torch.ones(3), "blob": Planted(str(victim))})

    def relabel(body):
        blob = next(e for e in body["storage_data"] if e["fqn"] == "blob")
        for entry in body["storage_data"]:
            if entry["fqn"] == "w":
                entry.update({k: blob[k] for k in ("file", "byte_offset", "length", "crc32c")})
                entry.update(encoding="bytes", dtype=None, shape=None)
        return body

    rewrite_metadata(store, relabel)
    error = refusal(url, {"w": torch.zeros(3)})
    assert "w is a tensor stored as bytes" in str(error)
    assert not victim.exists()


def test_plain_non_tensor_items_still_load_with_torchs_default_planner(tmp_path):
    state = {"w": torch.ones(2), "step": 7, "cfg": {"lr": 0.5, "name": "x"}, "t": [torch.ones(1)]}
    url, _ = saved(tmp_path, state)
    target = {"w": torch.zeros(2), "step": 0, "cfg": {"lr": 0.0, "name": ""}, "t": [torch.zeros(1)]}
    dcp.load(target, storage_reader=zd.Reader(url))
    assert target["step"] == 7 and target["cfg"] == {"lr": 0.5, "name": "x"}
    assert torch.equal(target["w"], torch.ones(2)) and torch.equal(target["t"][0], torch.ones(1))


def test_zephons_own_planner_refuses_the_same_pickle_naming_the_item(tmp_path):
    victim = tmp_path / "pwned"
    url, _ = saved(tmp_path, {"w": torch.ones(3), "blob": Planted(str(victim))})
    with pytest.raises(zd.UnsafeItemError, match="non-tensor item 'blob'"):
        zd.load({"w": torch.zeros(3), "blob": None}, zd.Reader(url))
    assert not victim.exists()
