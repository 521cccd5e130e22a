"""Every Zephon DCP save carries torch's own ``.metadata``: torch's stock ``FileSystemReader``
(local disk) and ``FsspecReader`` (moto S3) load it unchanged, bit for bit, while Zephon's reader
keeps reading the JSON and never unpickles. Also the blob format itself (``stock_format``) and
the payload directory that ``zephon latest``/``zephon checkpoints`` name for stock readers."""

from __future__ import annotations

import copy
import io
import json
import pickle
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from tests.zephon.dcp.test_single_process import awkward_state, flat
from zephon import dcp as zd
from zephon.dcp import stock_format
from zephon.dcp.stock_format import STOCK_METADATA_FILE, ShardStream, raw_span
from zephon.locations import stock_dcp_url


def training_state() -> dict:
    """A model and its AdamW state after two steps, plus non-tensor items."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "extra": {"epoch": 3, "name": "run-a", "lr": [0.1, 0.01]},
        **awkward_state(),
    }


def blank(state):
    """The same structure with every tensor zeroed and every other value replaced."""
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state).contiguous()
    return None if not isinstance(state, (int, float)) else -1


def assert_same(loaded: dict, saved: dict) -> None:
    got, want = flat(loaded), flat(saved)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def save(store, state, step=1, **kwargs) -> str:
    """Save through Zephon's writer; returns the payload directory's path."""
    zd.save(state, zd.ZephonStorageWriter(store.run("r").begin(step), **kwargs))
    return store.run("r").reader(step).path


@pytest.fixture
def store(local_backend):
    with local_backend.open_store() as opened:
        yield opened


@pytest.mark.parametrize("subdir, threads", [("", 1), ("model/dcp", 3)])
def test_a_training_save_loads_with_torchs_filesystem_reader(
    store, subdir, threads, parallel_shards
):
    state = training_state()
    payload = save(store, state, subdir=subdir, thread_count=threads)
    target = blank(state)
    directory = f"{payload}/{subdir}" if subdir else payload
    dcp.load(target, storage_reader=FileSystemReader(directory))
    assert_same(target, state)
    names = store.run("r").reader(1).names
    prefix = f"{subdir}/" if subdir else ""
    assert f"{prefix}{STOCK_METADATA_FILE}" in names  # listed by the marker like every file
    assert len([n for n in names if n.endswith(".distcp")]) == threads


def test_a_save_on_s3_loads_with_torchs_fsspec_reader(s3_backend):
    state = training_state()
    with s3_backend.open_store() as store:
        zd.save(state, zd.ZephonStorageWriter(store.run("r").begin(1), subdir="dcp"))
        manifest = store.run("r").read_manifest(1)
        directory = stock_dcp_url(store.run("r").reader(1).url, manifest.payload, manifest.metadata)
    assert directory.startswith("s3://") and directory.endswith(f"/{manifest.payload}/dcp")
    target = blank(state)
    dcp.load(target, storage_reader=FsspecReader(directory, **s3_backend.storage_options))
    assert_same(target, state)


def test_zephons_reader_still_loads_it_without_unpickling(store, monkeypatch):
    state = {"w": torch.randn(4, 3), "nested": {"b": torch.arange(5)}}
    save(store, state)

    def forbidden(*_a, **_k):
        raise AssertionError("something was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    target = blank(state)
    zd.load(target, zd.ZephonStorageReader(store, "r", 1))
    assert_same(target, state)


def test_a_view_is_saved_as_its_own_elements_not_its_whole_storage(store):
    big = torch.arange(1000 * 64, dtype=torch.float32).reshape(1000, 64)
    state = {"rows": big[10:12], "column": big[:, 3]}
    payload = save(store, state)
    total = sum(e.size for e in store.run("r").read_manifest(1).files if e.name.endswith(".distcp"))
    assert total < 4 * (2 * 64 + 1000) + 2 * 4096  # two small blobs, not 2 x 256 KB storages
    target = blank(state)
    dcp.load(target, storage_reader=FileSystemReader(payload))
    assert_same(target, state)


def test_the_json_slice_names_the_raw_bytes_inside_the_torch_save_blob(store):
    state = {"w": torch.randn(7, 5, dtype=torch.float64)}
    payload = save(store, state)
    metadata = zd.decode_metadata(
        store.run("r").reader(1).read_bytes("dcp_metadata.json"), where=""
    )
    (where,) = metadata.storage_data.values()
    with open(f"{payload}/{where.file}", "rb") as handle:
        data = handle.read()
    assert data[where.offset : where.offset + where.length] == state["w"].numpy().tobytes()
    assert raw_span(data) == (where.offset, where.length)  # the blob is the whole file here
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), state["w"])


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(1000, dtype=torch.float32),
        torch.zeros(0, 3),
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.rand(3, 4) > 0.5,
        torch.randn(2, 2, dtype=torch.complex64),
    ],
    ids=["float32", "empty", "bf16-scalar", "bool", "complex"],
)
def test_raw_span_finds_the_storage_bytes_of_a_torch_save_blob(tensor):
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    blob = buffer.getvalue()
    offset, length = raw_span(memoryview(blob))
    assert length == tensor.numel() * tensor.element_size()
    assert blob[offset : offset + length] == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_raw_span_refuses_what_is_not_a_one_tensor_blob():
    with pytest.raises(ValueError, match="no zip end-of-central-directory record"):
        raw_span(b"not a zip at all" * 4)
    buffer = io.BytesIO()
    torch.save([torch.ones(2), torch.zeros(3)], buffer)
    with pytest.raises(ValueError, match="holds 2 storage records"):
        raw_span(buffer.getvalue())


def test_latest_and_checkpoints_json_name_the_directory_for_stock_readers(cli, catalog, tmp_path):
    url = f"{tmp_path}/ckpt/r"
    with zd.Writer(url, catalog=catalog.url) as writer:
        for step in (1, 2):
            state = {"w": torch.full((3, 2), float(step)), "meta": {"step": step}}
            dcp.save(
                copy.deepcopy(state), storage_writer=writer, checkpoint_id=f"{url}/save-{step}"
            )
    code, out, _ = cli("latest", "r", "--json")
    assert code == 0
    latest = json.loads(out)
    assert latest["step"] == 2 and latest["stock_dcp_url"].startswith(latest["url"] + "/")
    target = {"w": torch.zeros(3, 2), "meta": {"step": 0}}
    dcp.load(target, storage_reader=FileSystemReader(latest["stock_dcp_url"]))
    assert torch.equal(target["w"], torch.full((3, 2), 2.0)) and target["meta"] == {"step": 2}
    code, out, _ = cli("checkpoints", "r", "--json")
    rows = {row["step"]: row for row in json.loads(out)}
    assert rows[2]["stock_dcp_url"] == latest["stock_dcp_url"]
    assert rows[1]["stock_dcp_url"].startswith(rows[1]["path"] + "/")
    target = {"w": torch.zeros(3, 2), "meta": {"step": 0}}
    dcp.load(target, storage_reader=FileSystemReader(rows[1]["stock_dcp_url"]))
    assert torch.equal(target["w"], torch.full((3, 2), 1.0))


def test_a_shard_stream_of_small_tensors_of_one_shape_gives_loadable_blobs():
    # the second blob of a dtype and shape reuses the first one's zip around its own elements
    out = io.BytesIO()

    def emit(view: memoryview) -> int:
        out.write(view)
        return 0

    stream = ShardStream(emit)
    tensors = [torch.randn(3, 4), torch.randn(3, 4), torch.tensor(True), torch.tensor(False)]
    tensors += [torch.zeros(0, 2), torch.zeros(0, 2), torch.randn(70_000)]  # the last: large
    blobs = [stream.add_tensor(t) for t in tensors]
    stream.close()
    data = out.getvalue()
    assert blobs[-1].start + blobs[-1].length == len(data)
    for tensor, blob in zip(tensors, blobs, strict=True):
        one = data[blob.start : blob.start + blob.length]
        assert raw_span(one) == (blob.raw_offset, blob.raw_length)
        loaded = torch.load(io.BytesIO(one), weights_only=True)
        assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)


def test_a_shard_stream_emits_a_large_tensor_as_a_lasting_view_of_its_own_memory():
    # the views it emits may be sent after emit returns (the native upload queues them): a
    # tensor's bytes must be a view that keeps the tensor alive, not torch.save's borrowed one
    emitted: list[memoryview] = []

    def emit(view: memoryview) -> int:
        emitted.append(view)
        return 0

    stream = ShardStream(emit)
    tensor = torch.randn(70_000)
    blob = stream.add_tensor(tensor)
    stream.close()
    large = [v for v in emitted if v.nbytes >= 64 * 1024]
    assert [v.nbytes for v in large] == [blob.raw_length]
    assert large[0].obj is not None  # it owns a reference to the memory it shows
    address = torch.frombuffer(large[0], dtype=torch.uint8).data_ptr()
    assert address == tensor.data_ptr()  # the tensor's own memory, not a copy
    expected = tensor.clone()
    del tensor  # the view alone keeps the bytes alive
    assert torch.equal(torch.frombuffer(large[0], dtype=torch.float32), expected)


def test_a_torch_without_the_internal_writer_gets_blobs_through_the_public_torch_save(
    monkeypatch,
):
    # the fast path calls torch internals (checked with this torch); a release without them
    # writes blobs through the public torch.save, which load and whose raw bytes are found
    without_internals = types.SimpleNamespace(
        _C=types.SimpleNamespace(), serialization=types.SimpleNamespace(), save=torch.save
    )
    monkeypatch.setattr(stock_format, "torch", without_internals)
    tensor = torch.randn(3, 4)
    out = io.BytesIO()
    stock_format._save_without_crc32(tensor, out, 64)
    blob = out.getvalue()
    offset, length = raw_span(blob)
    assert blob[offset : offset + length] == tensor.numpy().tobytes()
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), tensor)


FAILING_STORAGE = """
import gc
import torch
from zephon.dcp.stock_format import ShardStream

def emit(view):
    raise OSError("storage went away")

stream = ShardStream(emit)
try:
    stream.add_tensor(torch.randn(100_000))
except OSError as exc:
    print("raised", exc)
del stream
gc.collect()
print("alive")
"""


def test_a_write_failing_inside_a_blob_raises_and_later_garbage_collection_does_not_abort():
    # torch's zip writer finishes an unfinished archive in its C++ destructor; a write failing
    # there ends the process ("Aborted"): the stream must finish the archive when a save fails
    done = subprocess.run(
        [sys.executable, "-c", FAILING_STORAGE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["raised storage went away", "alive"]
