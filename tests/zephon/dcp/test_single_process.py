"""The writer, reader, planner and stager in one process (DCP without torch.distributed): exact
round trips of awkward tensors, ranged reads on S3, refusals, error translation."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import threading
from concurrent.futures import Future

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException

from tests.s3_calls import S3Calls
from zephon import dcp as zd
from zephon.errors import ZephonError
from zephon.storage import CheckpointNotFoundError, CorruptCheckpointError


def awkward_state() -> dict:
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    return {
        "plain": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "mask": torch.rand(9) > 0.5,
        "transposed": base.t(),  # not contiguous
        "complex": torch.randn(3, dtype=torch.complex64),
        "nested": {"ints": torch.arange(11, dtype=torch.int32), "list": [torch.ones(2)]},
    }


def fresh_like(state):
    if isinstance(state, dict):
        return {k: fresh_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [fresh_like(v) for v in state]
    return torch.zeros_like(state).contiguous()


def flat(state, prefix=""):
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, list):
        items = enumerate(state)
    else:
        return {prefix: state}
    out = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def save(store, state, step=1, run="r", **kwargs):
    writer = zd.ZephonStorageWriter(store.run(run).begin(step), **kwargs)
    zd.save(state, writer)
    return writer


@pytest.fixture
def store(local_backend):
    with local_backend.open_store() as opened:
        yield opened


def test_awkward_tensors_round_trip_bit_for_bit(store):
    state = awkward_state()
    save(store, state)
    target = fresh_like(state)
    zd.load(target, zd.ZephonStorageReader(store, "r", 1))
    for key, value in flat(state).items():
        loaded = flat(target)[key]
        assert loaded.dtype == value.dtype and loaded.shape == value.shape, key
        assert torch.equal(loaded, value), key


def test_a_target_of_another_dtype_receives_converted_values(store):
    save(store, {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    target = {"w": torch.zeros(2, 3, dtype=torch.float64)}
    zd.load(target, zd.ZephonStorageReader(store, "r", 1))
    assert torch.equal(target["w"], torch.arange(6, dtype=torch.float64).reshape(2, 3))


def test_commit_metadata_and_on_commit_see_the_manifest(store):
    seen = []
    writer = save(
        store,
        {"w": torch.ones(3)},
        commit_metadata=lambda md: {"keys": sorted(md.state_dict_metadata)},
        on_commit=seen.append,
    )
    manifest = store.run("r").read_manifest(1)
    assert seen == [writer.manifest] == [manifest]
    assert manifest.metadata["keys"] == ["w"]
    assert manifest.metadata["dcp"]["metadata"] == "dcp_metadata.json"


def test_files_can_live_under_a_subdirectory(store):
    save(store, {"w": torch.ones(3)}, subdir="model")
    names = store.run("r").reader(1).names
    assert names == ["model/.metadata", "model/__0_0.distcp", "model/dcp_metadata.json"]
    target = {"w": torch.zeros(3)}
    zd.load(target, zd.ZephonStorageReader(store, "r", 1, subdir="model"))
    assert torch.equal(target["w"], torch.ones(3))


def test_loading_never_unpickles_a_tensor_only_checkpoint(store, monkeypatch):
    save(store, {"w": torch.ones(3), "b": {"x": torch.zeros(2)}})

    def forbidden(*_a, **_k):
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    target = {"w": torch.zeros(3), "b": {"x": torch.ones(2)}}
    zd.load(target, zd.ZephonStorageReader(store, "r", 1))
    assert torch.equal(target["w"], torch.ones(3))


class Opaque:
    def __init__(self) -> None:
        self.x = 1


def test_non_tensor_items_load_only_through_the_restricted_unpickler(store):
    save(store, {"w": torch.ones(2), "blob": Opaque()})
    target = {"w": torch.zeros(2), "blob": None}
    with pytest.raises(zd.UnsafeItemError, match="'blob' .* restricted unpickler"):
        zd.load(target, zd.ZephonStorageReader(store, "r", 1))


def test_a_writer_refuses_another_checkpoint_id(store):
    writer = zd.ZephonStorageWriter(store.run("r").begin(1))
    with pytest.raises(zd.WriterSetupError, match="save-1"):
        writer.reset("/somewhere/else")
    writer.reset(writer.url)  # its own URL is fine


def test_the_coordinator_must_hold_the_primary_writer(store):
    store.run("r").begin(1)
    secondary = store.run("r").attach(1, save_id="x" * 32)
    with pytest.raises(zd.WriterSetupError, match="primary writer"):
        zd.save({"w": torch.ones(2)}, zd.ZephonStorageWriter(secondary))
    assert not store.run("r").is_committed(1)


def test_an_uncommitted_checkpoint_is_refused_naming_the_marker(store):
    store.run("r").begin(1).write_bytes("dcp_metadata.json", b"{}")
    with pytest.raises(CheckpointNotFoundError, match="_COMMIT"):
        zd.load({"w": torch.zeros(2)}, zd.ZephonStorageReader(store, "r", 1))


def test_unparseable_metadata_is_refused_naming_the_file(store):
    save(store, {"w": torch.ones(2)})
    path = store.run("r").reader(1).local_path("dcp_metadata.json")
    size = os.path.getsize(path)
    with open(path, "wb") as out:
        out.write(b"x" * size)  # same size: only a deep verify would notice
    # a marker without the metadata's copy (metadata above the copy limit): the file is read
    marker = store.run("r").marker_path(1)
    body = json.loads(store.run("r").marker_bytes(1))
    assert body.pop("inline").keys() == {"dcp_metadata.json"}
    with open(marker, "wb") as out:
        out.write(json.dumps(body).encode())
    with pytest.raises(CorruptCheckpointError, match="dcp_metadata.json"):
        zd.load({"w": torch.zeros(2)}, zd.ZephonStorageReader(store, "r", 1))


def test_metadata_naming_an_unlisted_file_is_refused(store):
    save(store, {"w": torch.ones(2)})
    metadata = zd.decode_metadata(
        store.run("r").reader(1).read_bytes("dcp_metadata.json"), where="x"
    )
    ((index, where),) = metadata.storage_data.items()
    metadata.storage_data = {index: dataclasses.replace(where, file="__9_9.distcp")}
    # committed with a manifest that matches the edited metadata, so only the slice is wrong
    writer = store.run("r").begin(2)
    writer.write_bytes("dcp_metadata.json", zd.encode_metadata(metadata))
    writer.commit()
    with pytest.raises(CorruptCheckpointError, match="__9_9.distcp: not listed"):
        zd.load({"w": torch.zeros(2)}, zd.ZephonStorageReader(store, "r", 2))


def test_a_missing_shard_is_refused_naming_it(store):
    save(store, {"w": torch.ones(2)})
    os.unlink(store.run("r").reader(1).local_path("__0_0.distcp"))
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError, match="__0_0.distcp of committed checkpoint"):
            zd.load({"w": torch.zeros(2)}, zd.ZephonStorageReader(store, "r", 1, verify=verify))


def test_partial_load_leaves_missing_keys_untouched(store):
    save(store, {"w": torch.ones(2)})
    target = {"w": torch.zeros(2), "new": torch.full((2,), 7.0)}
    zd.load(target, zd.ZephonStorageReader(store, "r", 1), allow_partial_load=True)
    assert torch.equal(target["w"], torch.ones(2))
    assert torch.equal(target["new"], torch.full((2,), 7.0))


# -- S3: ranged reads ---------------------------------------------------------------------------


class RecordGets(S3Calls):
    def __init__(self, fs) -> None:
        super().__init__(fs)
        self.ranges: list[str | None] = []
        #: (object key, Range header) of every GetObject; ``ranges`` those of the shards
        self.gets: list[tuple[str, str | None]] = []
        self.heads = 0

    def on_call(self, model, params):
        if model.name == "GetObject":
            key, wanted = params.get("url_path", ""), params.get("headers", {}).get("Range")
            self.gets.append((key, wanted))
            if key.endswith(".distcp"):
                self.ranges.append(wanted)
        elif model.name == "HeadObject":
            self.heads += 1


def test_s3_loads_read_only_the_ranges_needed_and_batch_neighbours(s3_backend):
    s3_backend.storage_options["native"] = False  # observes s3fs's own requests
    with s3_backend.open_store() as store:
        state = {f"small{i}": torch.full((256,), float(i)) for i in range(40)}  # 1 KiB each
        state["big"] = torch.randn(1 << 20)  # 4 MiB
        save(store, state, thread_count=1)
        fs = store.location.fs

        target = {"small3": torch.zeros(256)}
        with RecordGets(fs) as gets:
            zd.load(target, zd.ZephonStorageReader(store, "r", 1), allow_partial_load=True)
        assert torch.equal(target["small3"], state["small3"])
        shard_gets = [r for r in gets.ranges if r is not None]
        assert len(shard_gets) == 1
        # the marker, which carries the DCP metadata, and the shard: no HEAD before either
        assert len(gets.gets) == 2 and gets.heads == 0
        first, last = (int(x) for x in shard_gets[0].removeprefix("bytes=").split("-"))
        assert last - first + 1 == 1024  # one tensor's bytes, not the 4 MiB shard

        target = {k: torch.zeros_like(v) for k, v in state.items() if k != "big"}
        with RecordGets(fs) as gets:
            zd.load(target, zd.ZephonStorageReader(store, "r", 1), allow_partial_load=True)
        assert all(torch.equal(target[k], state[k]) for k in target)
        assert len([r for r in gets.ranges if r is not None]) == 1  # 40 neighbours, one request


def test_s3_round_trip_with_a_reshaping_read(s3_backend):
    with s3_backend.open_store() as store:
        state = awkward_state()
        save(store, state)
        target = fresh_like(state)
        zd.load(target, zd.ZephonStorageReader(store, "r", 1, verify=True))
        for key, value in flat(state).items():
            assert torch.equal(flat(target)[key], value), key


# -- stager ---------------------------------------------------------------------------------------


def test_the_stager_copies_and_reuses_its_buffers():
    stager = zd.ZephonStager()
    state = {"w": torch.ones(4), "groups": [{"lr": 0.1}]}
    staged = stager.stage(state)
    state["w"].add_(1)
    state["groups"][0]["lr"] = 0.5
    assert torch.equal(staged["w"], torch.ones(4))
    assert staged["groups"][0]["lr"] == 0.1
    again = stager.stage(state)
    assert again["w"].data_ptr() == staged["w"].data_ptr()
    assert torch.equal(again["w"], torch.full((4,), 2.0))
    stager.close()


def test_the_stager_waits_for_the_save_using_its_buffers():
    stager = zd.ZephonStager()
    previous: Future = Future()
    stager.track(previous)
    waited = threading.Event()

    def wait():
        stager.wait_idle()
        waited.set()

    thread = threading.Thread(target=wait)
    thread.start()
    assert not waited.wait(0.2)
    previous.set_exception(RuntimeError("that save failed; its own future reports it"))
    assert waited.wait(5)
    thread.join()


def test_async_save_without_torch_distributed_round_trips(store):
    stager = zd.ZephonStager()
    state = {"w": torch.ones(3)}
    future = zd.async_save(state, zd.ZephonStorageWriter(store.run("r").begin(1)), stager=stager)
    state["w"].add_(5)
    future.result(timeout=60)
    target = {"w": torch.zeros(3)}
    zd.load(target, zd.ZephonStorageReader(store, "r", 1))
    assert torch.equal(target["w"], torch.ones(3))
    stager.close()


# -- error translation and attach ---------------------------------------------------------------


def wrapped(failures: dict) -> CheckpointException:
    return CheckpointException("write", {r: (e, None) for r, e in failures.items()})


def test_the_lowest_ranks_zephon_error_is_raised_as_it_was():
    own = CorruptCheckpointError("bad shard __1_0.distcp")
    exc = wrapped({0: RuntimeError("boom"), 1: own})
    assert zd.as_zephon_error(exc, where="u") is own
    assert "rank 1" in own.__notes__[0]


def test_foreign_failures_become_one_error_naming_every_rank():
    exc = wrapped({1: RuntimeError("boom"), 0: ValueError("bad")})
    error = zd.as_zephon_error(exc, where="s3://b/r/save-3")
    assert isinstance(error, zd.DistributedCheckpointError) and isinstance(error, ZephonError)
    assert "rank 0: ValueError: bad; rank 1: RuntimeError: boom" in str(error)
    assert "s3://b/r/save-3" in str(error)
    assert set(error.failures) == {0, 1}


def test_attach_ranks_without_torch_distributed_returns_the_primary(store):
    primary = store.run("r").begin(1)
    assert zd.attach_ranks(store, "r", 1, primary) is primary
    with pytest.raises(zd.WriterSetupError):
        zd.attach_ranks(store, "r", 1, None)
