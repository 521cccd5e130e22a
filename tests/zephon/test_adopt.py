"""``zephon adopt``: stock DCP checkpoints written by torch's own ``FileSystemWriter`` become
checkpoints of a Zephon run that ``zephon.dcp.Reader`` loads bit for bit; hostile or damaged
ones are refused without running anything."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex

from tests.conftest import make_backend
from zephon import dcp as zd
from zephon.adopt import adopt
from zephon.dcp.errors import StockCheckpointError
from zephon.dcp.stock_loader import StockItem, read_stock_metadata, tensor_span
from zephon.errors import ConfigError
from zephon.storage import CheckpointStore

# -- stock checkpoints, written by torch itself -------------------------------------------------


def training_state(seed: int) -> dict:
    """Model + AdamW state after two steps, a tensor view into a larger storage, and
    non-tensor items: what a training job hands to ``dcp.save``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
    big = torch.randn(6, 3)
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "view": big[2:4],  # torch.save keeps the whole storage: the bytes start at an offset
        "extra": {"epoch": seed, "note": f"seed {seed}"},
    }


def write_stock(path: str, seed: int, **writer_options) -> dict:
    state = training_state(seed)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, **writer_options))
    return state


def blank_like(state):
    """A state of the same structure to load into (zeros; other non-tensor values)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: blank_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank_like(v) for v in state]
    if isinstance(state, tuple):
        return tuple(blank_like(v) for v in state)
    if isinstance(state, str):
        return ""
    return state if isinstance(state, bool | type(None)) else 0


def assert_exact(loaded, saved, where="state"):
    if isinstance(saved, torch.Tensor):
        assert loaded.dtype == saved.dtype and loaded.shape == saved.shape, where
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (loaded, saved)]
        assert torch.equal(*as_bytes), where
    elif isinstance(saved, dict):
        assert set(loaded) == set(saved), where
        for k in saved:
            assert_exact(loaded[k], saved[k], f"{where}.{k}")
    elif isinstance(saved, list | tuple):
        assert len(loaded) == len(saved), where
        for i, (a, b) in enumerate(zip(loaded, saved, strict=True)):
            assert_exact(a, b, f"{where}[{i}]")
    else:
        assert loaded == saved, where


def load_run(run_url: str, like: dict, **reader_kwargs) -> tuple[dict, int]:
    state = blank_like(like)
    reader = zd.Reader(run_url, **reader_kwargs)
    dcp.load(state, storage_reader=reader)
    return state, reader.step


# -- adopting -------------------------------------------------------------------------------


def test_a_stock_checkpoint_is_adopted_into_a_local_run_and_loads_bit_for_bit(tmp_path, catalog):
    saved = write_stock(str(tmp_path / "stock"), seed=1)
    run_url = str(tmp_path / "ckpt" / "my-run")

    report = adopt(str(tmp_path / "stock"), run_url, step=100, catalog=catalog)

    assert report.adopted == [100] and report.skipped == []
    loaded, step = load_run(run_url, saved, catalog=catalog)
    assert step == 100
    assert_exact(loaded, saved)
    row = catalog.get_checkpoint("my-run", 100)
    assert row.state == "committed" and row.bytes > 0 and row.file_count == 3
    # like every Zephon save it carries Zephon's JSON and torch's own .metadata (written anew
    # from the allowlisted objects), so a stock reader loads the adopted checkpoint too
    store = CheckpointStore(str(tmp_path / "ckpt"))
    names = [f.name for f in store.run("my-run").reader(100).manifest.files]
    assert "dcp_metadata.json" in names and ".metadata" in names
    stock = blank_like(saved)
    directory = zd.stock_directory(store.run("my-run").reader(100))
    dcp.load(stock, storage_reader=dcp.FileSystemReader(directory))
    assert_exact(stock, saved)


def test_a_checkpoint_of_several_shard_files_is_adopted_whole(tmp_path):
    saved = write_stock(str(tmp_path / "stock"), seed=5, thread_count=3)
    shards = sorted(n for n in os.listdir(tmp_path / "stock") if n.endswith(".distcp"))
    assert len(shards) == 3
    run_url = str(tmp_path / "ckpt" / "r")

    report = adopt(str(tmp_path / "stock"), run_url, step=1)

    assert report.steps[0].files == 3
    loaded, _ = load_run(run_url, saved)
    assert_exact(loaded, saved)
    manifest = CheckpointStore(str(tmp_path / "ckpt")).run("r").reader(1).manifest
    assert sorted(f.name for f in manifest.files if f.name.endswith(".distcp")) == shards


def test_adopting_into_an_s3_run_copies_from_local_disk_and_loads_bit_for_bit(
    tmp_path, request, sqlite_catalog
):
    backend = make_backend("s3", request, tmp_path)
    saved = write_stock(str(tmp_path / "stock"), seed=2)
    run_url = f"{backend.url}/my-run"

    report = adopt(
        str(tmp_path / "stock"),
        run_url,
        step=7,
        catalog=sqlite_catalog,
        storage_options=backend.storage_options,
    )

    assert report.adopted == [7] and report.steps[0].copied_on_server == 0  # streamed
    loaded, step = load_run(run_url, saved, storage_options=backend.storage_options)
    assert step == 7
    assert_exact(loaded, saved)
    assert sqlite_catalog.get_checkpoint("my-run", 7).state == "committed"


def test_a_stock_checkpoint_on_s3_is_copied_on_the_server_into_a_run_in_the_same_bucket(
    tmp_path, request, sqlite_catalog
):
    import fsspec

    backend = make_backend("s3", request, tmp_path)
    saved = write_stock(str(tmp_path / "stock"), seed=3)
    fs = fsspec.filesystem("s3", **backend.storage_options)
    source = f"{backend.url}/stock/ckpt-3"
    for name in os.listdir(tmp_path / "stock"):
        fs.put_file(str(tmp_path / "stock" / name), f"{source}/{name}")

    report = adopt(source, f"{backend.url}/runs/r", step=3, storage_options=backend.storage_options)

    assert report.steps[0].copied_on_server == 1  # CopyObject: no bytes uploaded

    loaded, _ = load_run(f"{backend.url}/runs/r", saved, storage_options=backend.storage_options)
    assert_exact(loaded, saved)
    runs = CheckpointStore(f"{backend.url}/runs", backend.storage_options)
    assert runs.run("r").verify(3, deep=True).ok  # the manifest's CRC32Cs are the copy's


def test_a_refusal_after_a_server_side_copy_leaves_nothing_in_the_run(tmp_path, request):
    import fsspec

    backend = make_backend("s3", request, tmp_path)
    write_stock(str(tmp_path / "stock"), seed=4)
    sentinel = tmp_path / "sentinel"
    evil = pickle.dumps(_RunsCommand(f"touch {sentinel}"))
    _rewrite_item(str(tmp_path / "stock"), "model.2.bias", _blob_with_pickle(evil))
    fs = fsspec.filesystem("s3", **backend.storage_options)
    source = f"{backend.url}/stock"
    for name in os.listdir(tmp_path / "stock"):
        fs.put_file(str(tmp_path / "stock" / name), f"{source}/{name}")

    with pytest.raises(StockCheckpointError, match=r"'model.2.bias': refused"):
        adopt(source, f"{backend.url}/runs/r", step=3, storage_options=backend.storage_options)

    assert not sentinel.exists()
    fs.invalidate_cache()
    assert fs.find(f"{backend.url}/runs/r/save-3") == []


def test_a_directory_of_step_folders_is_adopted_in_step_order_in_one_call(tmp_path, sqlite_catalog):
    states = {
        step: write_stock(str(tmp_path / "titan" / f"step-{step}"), seed=step)
        for step in (30, 10, 20)
    }
    os.makedirs(tmp_path / "titan" / "tb-logs")  # anything else in the folder is left alone
    run_url = str(tmp_path / "ckpt" / "titan-run")
    said = []

    report = adopt(str(tmp_path / "titan"), run_url, catalog=sqlite_catalog, progress=said.append)

    assert report.adopted == [10, 20, 30]
    assert said == [f"step {s}: adopting {tmp_path}/titan/step-{s}" for s in (10, 20, 30)]
    assert [r.step for r in sqlite_catalog.list_checkpoints("titan-run")] == [10, 20, 30]
    latest, step = load_run(run_url, states[30], catalog=sqlite_catalog)
    assert step == 30
    assert_exact(latest, states[30])
    first, _ = load_run(run_url, states[10], step=10)
    assert_exact(first, states[10])

    again = adopt(str(tmp_path / "titan"), run_url, catalog=sqlite_catalog)
    assert again.adopted == [] and again.skipped == [10, 20, 30]
    assert again.steps[0].skipped == "the run holds this step already"


def test_the_step_is_required_for_one_checkpoint_and_refused_for_step_folders(tmp_path):
    write_stock(str(tmp_path / "one"), seed=1)
    write_stock(str(tmp_path / "many" / "step-5"), seed=5)
    with pytest.raises(ConfigError, match=r"one stock checkpoint: give the step .*--step N"):
        adopt(str(tmp_path / "one"), str(tmp_path / "ckpt" / "r"))
    with pytest.raises(ConfigError, match=r"step-<N> checkpoints, whose steps are their names"):
        adopt(str(tmp_path / "many"), str(tmp_path / "ckpt" / "r"), step=5)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(StockCheckpointError, match=r"holds no \.metadata and no step-<N>"):
        adopt(str(tmp_path / "empty"), str(tmp_path / "ckpt" / "r"), step=1)


def test_a_step_below_the_runs_latest_is_refused_before_anything_is_written(tmp_path):
    from zephon.errors import SaveBelowLatestError

    write_stock(str(tmp_path / "stock"), seed=1)
    run_url = str(tmp_path / "ckpt" / "r")
    adopt(str(tmp_path / "stock"), run_url, step=10)

    with pytest.raises(
        SaveBelowLatestError,
        match=r"refusing to adopt step 5 below its latest checkpoint 10: adopt it into another",
    ):
        adopt(str(tmp_path / "stock"), run_url, step=5)
    assert CheckpointStore(str(tmp_path / "ckpt")).run("r").committed_steps() == [10]


# -- refusals: nothing runs, nothing is committed ------------------------------------------------


class _RunsCommand:
    """A pickle that would run a shell command when unpickled by plain ``pickle``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _NamesGlobal:
    """A pickle naming a global outside every allowlist (``subprocess.getoutput``)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        import subprocess

        return (subprocess.getoutput, (self.command,))


@pytest.mark.parametrize("payload", [_RunsCommand, _NamesGlobal])
def test_a_metadata_pickle_that_would_run_code_is_refused_without_running_it(tmp_path, payload):
    write_stock(str(tmp_path / "stock"), seed=1)
    sentinel = tmp_path / "sentinel"
    with open(tmp_path / "stock" / ".metadata", "wb") as out:
        pickle.dump(payload(f"touch {sentinel}"), out)
    run_url = str(tmp_path / "ckpt" / "r")

    with pytest.raises(StockCheckpointError, match=r"\.metadata: refused by the restricted") as e:
        adopt(str(tmp_path / "stock"), run_url, step=1)

    assert "nothing of it ran" in str(e.value) and "\n" not in str(e.value)
    assert not sentinel.exists()
    assert CheckpointStore(str(tmp_path / "ckpt")).run("r").committed_steps() == []


def _rewrite_item(stock_dir: str, fqn: str, blob: bytes) -> None:
    """Replace one item's bytes in a stock checkpoint we wrote ourselves (so plain pickle may
    read its metadata here), moving every other item of its file to keep them consistent."""
    path = os.path.join(stock_dir, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # noqa: S301 - written by this test
    index = next(i for i in md.storage_data if i.fqn == fqn)
    target = md.storage_data[index].relative_path
    with open(os.path.join(stock_dir, target), "rb") as f:
        data = f.read()
    out, position = bytearray(), 0
    for i, info in sorted(md.storage_data.items(), key=lambda p: p[1].offset):
        if info.relative_path != target:
            continue
        piece = blob if i == index else data[info.offset : info.offset + info.length]
        info.offset, info.length = position, len(piece)
        out += piece
        position += len(piece)
    with open(os.path.join(stock_dir, target), "wb") as f:
        f.write(out)
    with open(path, "wb") as f:
        pickle.dump(md, f)


def _blob_with_pickle(pickled: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", b"\0" * 128)
    return buffer.getvalue()


def test_a_tensor_blob_whose_pickle_would_run_code_is_refused_and_the_save_failed(
    tmp_path, sqlite_catalog
):
    write_stock(str(tmp_path / "stock"), seed=1)
    sentinel = tmp_path / "sentinel"
    evil = pickle.dumps(_RunsCommand(f"touch {sentinel}"))
    _rewrite_item(str(tmp_path / "stock"), "model.0.weight", _blob_with_pickle(evil))
    run_url = str(tmp_path / "ckpt" / "r")

    with pytest.raises(StockCheckpointError, match=r"'model.0.weight': refused by the restricted"):
        adopt(str(tmp_path / "stock"), run_url, step=4, catalog=sqlite_catalog)

    assert not sentinel.exists()
    assert CheckpointStore(str(tmp_path / "ckpt")).run("r").committed_steps() == []
    assert sqlite_catalog.get_checkpoint("r", 4).state == "failed"


def test_a_truncated_shard_file_is_refused_before_anything_is_written(tmp_path):
    write_stock(str(tmp_path / "stock"), seed=1)
    shard = tmp_path / "stock" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)

    with pytest.raises(
        StockCheckpointError, match=r"__0_0\.distcp has .* bytes, but its items reach"
    ):
        adopt(str(tmp_path / "stock"), str(tmp_path / "ckpt" / "r"), step=1)
    assert CheckpointStore(str(tmp_path / "ckpt")).run("r").list_steps() == []


def test_a_truncated_tensor_blob_is_refused(tmp_path):
    write_stock(str(tmp_path / "stock"), seed=1)
    with open(tmp_path / "stock" / ".metadata", "rb") as f:
        md = pickle.load(f)  # noqa: S301 - written by this test
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.2.weight")
    with open(tmp_path / "stock" / info.relative_path, "rb") as f:
        blob = f.read()[info.offset : info.offset + info.length]
    _rewrite_item(str(tmp_path / "stock"), "model.2.weight", blob[:-300])

    with pytest.raises(StockCheckpointError, match=r"'model.2.weight': is not a whole torch.save"):
        adopt(str(tmp_path / "stock"), str(tmp_path / "ckpt" / "r"), step=1)
    assert CheckpointStore(str(tmp_path / "ckpt")).run("r").committed_steps() == []


def test_compressed_items_are_refused_naming_the_fix(tmp_path):
    write_stock(str(tmp_path / "stock"), seed=1)
    path = tmp_path / "stock" / ".metadata"
    with open(path, "rb") as f:
        md = pickle.load(f)  # noqa: S301 - written by this test
    next(iter(md.storage_data.values())).transform_descriptors = ["zstd"]
    with open(path, "wb") as f:
        pickle.dump(md, f)

    with pytest.raises(StockCheckpointError, match=r"transforms \['zstd'\].*without compression"):
        adopt(str(tmp_path / "stock"), str(tmp_path / "ckpt" / "r"), step=1)


def test_a_non_contiguous_tensor_blob_is_refused():
    buffer = io.BytesIO()
    torch.save(torch.arange(6.0).reshape(2, 3).t(), buffer)
    item = StockItem(MetadataIndex("t"), "f", 0, 0, torch.float32, (3, 2))
    with pytest.raises(StockCheckpointError, match=r"non-contiguous view \(stride \[1, 3\]"):
        tensor_span(buffer.getvalue(), item, where="f")


def test_the_tensor_bytes_of_a_view_are_found_inside_its_whole_storage():
    base = torch.arange(12, dtype=torch.int64)
    buffer = io.BytesIO()
    torch.save(base[4:7], buffer)
    blob = buffer.getvalue()
    start, length = tensor_span(
        blob, StockItem(MetadataIndex("v"), "f", 0, 0, torch.int64, (3,)), where="f"
    )
    assert length == 24
    assert torch.frombuffer(
        bytearray(blob[start : start + length]), dtype=torch.int64
    ).tolist() == [4, 5, 6]


class _ChangesEnumMember:
    """A pickle of allowlisted globals only, that would set the state of a shared object (an
    enum member torch uses process-wide)."""

    def __reduce__(self):
        from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

        return (_MEM_FORMAT_ENCODING, (0,), {"_value_": 2})


def _builds_a_class() -> bytes:
    """A pickle that names the allowlisted class ``Metadata`` and sets an attribute of the
    class itself (BUILD on a global), which would outlive the load."""
    state = pickle.dumps((None, {"zephon_test_marker": 1}), protocol=2)[2:-1]
    return b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n" + state + b"b."


@pytest.mark.parametrize(
    "data", [pickle.dumps(_ChangesEnumMember()), _builds_a_class()], ids=["enum", "class"]
)
def test_a_pickle_that_would_change_a_shared_object_is_refused(data):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    with pytest.raises(StockCheckpointError, match=r"restricted unpickler: it sets the state"):
        read_stock_metadata(data, where="x/.metadata")
    assert _MEM_FORMAT_ENCODING(0).value == 0 and not hasattr(Metadata, "zephon_test_marker")


def test_metadata_that_is_no_dcp_metadata_is_refused():
    with pytest.raises(StockCheckpointError, match=r"holds a dict, not DCP Metadata"):
        read_stock_metadata(pickle.dumps({"a": 1}), where="x/.metadata")
    with pytest.raises(StockCheckpointError, match=r"not a readable pickle"):
        read_stock_metadata(b"\x80\x05garbage", where="x/.metadata")


# -- the command ------------------------------------------------------------------------------


def test_zephon_adopt_prints_json_and_records_the_row(tmp_path, cli):
    write_stock(str(tmp_path / "stock"), seed=1)
    run_url = str(tmp_path / "ckpt" / "cli-run")

    code, out, err = cli("adopt", str(tmp_path / "stock"), run_url, "--step", "12", "--json")

    assert code == 0, err
    report = json.loads(out)
    assert report["adopted"] == [12] and report["steps"][0]["url"] == f"{run_url}/save-12"
    code, out, _ = cli("checkpoints", "cli-run", "--json")
    assert code == 0 and [(r["step"], r["state"]) for r in json.loads(out)] == [(12, "committed")]
    code, out, _ = cli("adopt", str(tmp_path / "stock"), run_url, "--step", "12")
    assert code == 0 and out.startswith("skipped step 12: the run holds this step already")


def test_zephon_adopt_refusals_are_one_line(tmp_path, cli):
    write_stock(str(tmp_path / "stock"), seed=1)
    with open(tmp_path / "stock" / ".metadata", "wb") as out:
        pickle.dump(_RunsCommand(f"touch {tmp_path / 'sentinel'}"), out)
    code, out, err = cli(
        "adopt", str(tmp_path / "stock"), str(tmp_path / "ckpt" / "r"), "--step", "1"
    )
    assert code == 6 and out == ""
    assert err.startswith("zephon: error: ") and err.count("\n") == 1
    assert "posix.system" in err and not (tmp_path / "sentinel").exists()
