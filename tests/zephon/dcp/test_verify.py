"""Verification on load: every slice's bytes are checked against the CRC32C recorded at save time
as they arrive, on local disk and on S3 (moto), with real files and real torch DCP.

Damage is done the way it happens: bytes changed in place, a file cut short, two files of the
same size exchanged. Each must raise ``CorruptCheckpointError`` naming the file; ``verify=False``
is shown loading a changed byte silently, the trade it makes for reading less.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from tests.conftest import DISK_AND_OBJECT_STORE, make_backend
from tests.ranks import launch, store_config
from tests.s3_calls import S3Calls
from zephon import dcp as zd
from zephon.dcp.metadata_codec import ShardSlice
from zephon.storage import CorruptCheckpointError
from zephon.storage.checksum import crc32c_of

RUN = "r"
METADATA = "dcp_metadata.json"
PROBLEM = re.compile(r"^(\S+): crc32c of (\S+) is (\S{8}), the checkpoint says (\S{8})$")


@pytest.fixture(params=DISK_AND_OBJECT_STORE)
def store(request, tmp_path):
    with make_backend(request.param, request, tmp_path).open_store() as opened:
        yield opened


def two_tensors() -> dict:
    torch.manual_seed(0)
    return {"a": torch.randn(64, 32), "b": torch.randn(64, 32)}


def save(store, state, step=1, thread_count=2):
    zd.save(state, zd.ZephonStorageWriter(store.run(RUN).begin(step), thread_count=thread_count))


def load(store, state, step=1, **kwargs) -> dict:
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    zd.load(target, zd.ZephonStorageReader(store, RUN, step, **kwargs))
    return target


def slices(store, step=1) -> dict[str, ShardSlice]:
    reader = store.run(RUN).reader(step)
    metadata = zd.decode_metadata(reader.read_bytes(METADATA), where=METADATA)
    return {index.fqn: where for index, where in metadata.storage_data.items()}


def rewrite(store, name, edit, step=1) -> None:
    """Replace file ``name`` of the checkpoint with ``edit(its bytes)``, behind Zephon's back."""
    fs = store.location.fs
    path = f"{store.run(RUN).reader(step).path}/{name}"
    fs.pipe_file(path, edit(fs.cat_file(path)))


def flip(position: int):
    def edit(data: bytes) -> bytes:
        changed = bytearray(data)
        changed[position] ^= 0x10
        return bytes(changed)

    return edit


def assert_names(error: CorruptCheckpointError, store, name: str, step: int = 1) -> None:
    assert error.path == name
    assert name in str(error) and store.run(RUN).checkpoint_url(step) in str(error)
    assert "resume from an earlier checkpoint" in str(error)


# -- what the writer records ----------------------------------------------------------------------


def test_every_slice_records_the_crc32c_of_its_bytes_and_the_manifest_that_of_the_file(store):
    state = {**two_tensors(), "step": 7, "empty": torch.empty(0, 3)}
    save(store, state)
    reader = store.run(RUN).reader(1)
    files = {name: reader.read_bytes(name) for name in reader.names}
    recorded = slices(store)
    assert set(recorded) == {"a", "b", "step", "empty"}
    for fqn, where in recorded.items():
        data = files[where.file][where.offset : where.offset + where.length]
        assert where.crc32c == crc32c_of(data), fqn
    for entry in reader.manifest.files:
        assert entry.crc32c == crc32c_of(files[entry.name]), entry.name
    body = json.loads(files[METADATA])
    assert body["format_version"] == 2
    assert reader.manifest.metadata["dcp"]["format_version"] == 2


# -- damage is refused naming the file ------------------------------------------------------------


def test_a_flipped_byte_inside_a_tensor_is_refused_naming_the_file_and_the_tensor(store):
    state = two_tensors()
    save(store, state)
    where = slices(store)["b"]
    rewrite(store, where.file, flip(where.offset + 1000))
    with pytest.raises(CorruptCheckpointError) as info:
        load(store, state)
    assert_names(info.value, store, where.file)
    (problem,) = info.value.problems
    name, fqn, found, recorded = PROBLEM.match(problem).groups()
    assert (name, fqn, recorded) == (where.file, "b", where.crc32c)
    assert found != recorded


def test_a_flipped_byte_in_a_non_tensor_item_is_refused(store):
    state = {"w": torch.ones(4), "tag": "zephon run 7"}  # saved by DCP as a bytes item
    save(store, state, thread_count=1)
    where = slices(store)["tag"]
    assert where.encoding == "bytes"
    rewrite(store, where.file, flip(where.offset + where.length // 2))
    target = {"w": torch.zeros(4), "tag": None}
    with pytest.raises(CorruptCheckpointError, match="crc32c of tag is") as info:
        zd.load(target, zd.ZephonStorageReader(store, RUN, 1))
    assert_names(info.value, store, where.file)


def test_a_truncated_shard_is_refused_naming_the_file(store):
    state = two_tensors()
    save(store, state)
    name = slices(store)["a"].file
    rewrite(store, name, lambda data: data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="shorter than its manifest") as info:
        load(store, state)
    assert_names(info.value, store, name)
    assert info.value.problems == [f"{name}: truncated"]


def test_two_shard_files_of_the_same_size_swapped_are_refused_naming_a_file(store, parallel_shards):
    state = two_tensors()
    save(store, state)
    first, second = slices(store)["a"].file, slices(store)["b"].file
    reader = store.run(RUN).reader(1)
    sizes = {e.name: e.size for e in reader.manifest.files}
    assert first != second and sizes[first] == sizes[second]  # sizes alone cannot tell
    data = {name: store.location.fs.cat_file(f"{reader.path}/{name}") for name in (first, second)}
    rewrite(store, first, lambda _: data[second])
    rewrite(store, second, lambda _: data[first])
    with pytest.raises(CorruptCheckpointError) as info:
        load(store, state)
    assert info.value.path in {first, second}
    assert_names(info.value, store, info.value.path)
    assert PROBLEM.match(info.value.problems[0]).group(1) == info.value.path


def test_without_verification_a_flipped_byte_loads_silently(store):
    # The trade verify=False makes: fewer bytes read on a resharded load, and damage unnoticed.
    state = two_tensors()
    save(store, state)
    where = slices(store)["a"]
    rewrite(store, where.file, flip(where.offset + 4 * 100 + 3))
    loaded = load(store, state, verify=False)
    assert torch.equal(loaded["b"], state["b"])
    differs = (loaded["a"] != state["a"]).flatten().nonzero().flatten().tolist()
    assert differs == [100]


def test_verifying_reads_each_slice_once_and_nothing_else(s3_backend, parallel_shards):
    # No second pass: the checked bytes are the bytes delivered, one ranged GET per shard here.
    s3_backend.storage_options["native"] = False  # observes s3fs's own requests
    with s3_backend.open_store() as store:
        state = two_tensors()
        save(store, state)
        shards = {where.file for where in slices(store).values()}
        with RecordObjectGets(store.location.fs) as gets:
            loaded = load(store, state)
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        shard_gets = [
            (key.rsplit("/", 1)[-1], rng) for key, rng in gets.calls if key.endswith(".distcp")
        ]
        assert sorted(name for name, _ in shard_gets) == sorted(shards)
        # 64 x 32 float32 each: exactly the raw bytes inside each tensor's torch.save blob
        spans = {f"bytes={w.offset}-{w.offset + w.length - 1}" for w in slices(store).values()}
        assert all(w.length == 8192 for w in slices(store).values())
        assert {rng for _, rng in shard_gets} == spans


class RecordObjectGets(S3Calls):
    """The key and Range header of every GetObject an s3fs filesystem sends."""

    def __init__(self, fs) -> None:
        super().__init__(fs)
        self.calls: list[tuple[str, str | None]] = []

    def on_call(self, model, params):
        if model.name == "GetObject":
            key = params.get("url_path", "")
            self.calls.append((key, params.get("headers", {}).get("Range")))


# -- resharded reads ------------------------------------------------------------------------------


class Collect:
    """The two methods of a LoadPlanner that tensor reads use."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.committed: list[str] = []

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        return self.targets[req.dest_index.fqn]

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(req.dest_index.fqn)


def read_rows(store, start: int, count: int, *, verify: bool) -> torch.Tensor:
    """Rows ``start..start+count`` of the saved (64, 32) tensor ``a``, the way a resharded load
    asks for them: one ReadItem cutting the saved slice along its first dimension."""
    reader = zd.ZephonStorageReader(store, RUN, 1, verify=verify)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    target = torch.zeros(count, 32)
    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("a", [0, 0]),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("a", [0, 0]),
        storage_offsets=torch.Size([start, 0]),
        lengths=torch.Size([count, 32]),
    )
    planner = Collect({"a": target})
    reader.read_data(LoadPlan([req]), planner).wait()
    assert planner.committed == ["a"]
    return target


def test_a_resharded_read_fetches_the_whole_slice_and_verifies_it(store):
    state = two_tensors()
    save(store, state)
    for verify in (True, False):
        assert torch.equal(read_rows(store, 10, 20, verify=verify), state["a"][10:30])
    where = slices(store)["a"]
    if store.location.backend.posix_paths:
        return
    native = getattr(store.location.backend, "native", None)
    for verify, expected in ((True, where.length), (False, 20 * 32 * 4)):
        seen: list[tuple[str, int, int]] = []
        if native is not None:  # the native client's ranged GETs
            native.observers.append(lambda *request, seen=seen: seen.append(request))
            read_rows(store, 10, 20, verify=verify)
            native.observers.clear()
        else:
            with RecordObjectGets(store.location.fs) as gets:
                read_rows(store, 10, 20, verify=verify)
            for key, header in gets.calls:
                if not key.endswith(".distcp"):
                    continue
                first, last = (int(x) for x in header.removeprefix("bytes=").split("-"))
                seen.append((key, first, last + 1))
        ((first, end),) = [(s, e) for key, s, e in seen if key.endswith(".distcp")]
        assert end - first == expected, verify


@pytest.mark.parametrize(("row", "read"), [(15, True), (0, False)])
def test_a_resharded_read_detects_a_flipped_byte_of_its_slice(store, row, read):
    # Row 15 is among the rows read; row 0 is not, but lies in the same saved slice, which a
    # verified read fetches whole: both are refused. Without verification only the rows asked
    # for are read, and a flipped byte in them arrives unnoticed.
    state = two_tensors()
    save(store, state)
    where = slices(store)["a"]
    rewrite(store, where.file, flip(where.offset + row * 32 * 4 + 2))
    with pytest.raises(CorruptCheckpointError, match="crc32c of a is") as info:
        read_rows(store, 10, 20, verify=True)
    assert_names(info.value, store, where.file)
    unverified = read_rows(store, 10, 20, verify=False)
    assert torch.equal(unverified, state["a"][10:30]) == (not read)


@pytest.fixture(scope="module", params=DISK_AND_OBJECT_STORE)
def ranks(request, tmp_path_factory) -> list[dict]:
    backend = make_backend(request.param, request, tmp_path_factory.mktemp("verify"))
    return launch("tests.zephon.dcp.verify_worker", 2, store_config(backend))


@pytest.mark.slow
def test_two_gloo_ranks_load_a_narrowed_dtensor_and_verify_it(ranks):
    # each rank needed only its own rows of the one saved slice of w
    assert [r["resharded_equal"] for r in ranks] == [True, True]


@pytest.mark.slow
def test_two_gloo_ranks_both_refuse_a_byte_flipped_in_one_ranks_rows(ranks):
    name = ranks[0]["file"]
    for record in ranks:
        error = record["verified_flip"]
        assert error is not None, f"rank {record['rank']} loaded a damaged checkpoint"
        assert error["type"] == "CorruptCheckpointError" and error["path"] == name, error
        assert PROBLEM.match(error["problems"][0]).groups()[:2] == (name, "w")
    # without verification the damaged rows reach the last rank only, silently
    assert [r["unverified_flip_equal"] for r in ranks] == [True, False]


# -- version 1 checkpoints ------------------------------------------------------------------------


def as_version_1(store, step=1, new_step=2) -> None:
    """Commit ``new_step`` as the first format wrote it: the same shards, metadata without
    per-slice checksums."""
    reader = store.run(RUN).reader(step)
    body = json.loads(reader.read_bytes(METADATA))
    body["format_version"] = 1
    for entry in body["storage_data"]:
        del entry["crc32c"]
    writer = store.run(RUN).begin(new_step)
    for name in reader.names:
        if name != METADATA:
            writer.write_bytes(name, reader.read_bytes(name))
    writer.write_bytes(METADATA, json.dumps(body).encode())
    writer.commit({"dcp": {"format_version": 1, "metadata": METADATA}})


def test_a_version_1_checkpoint_still_loads_with_and_without_verification(store):
    state = two_tensors()
    save(store, state)
    as_version_1(store)
    assert {w.crc32c for w in slices(store, 2).values()} == {None}
    for verify in (True, False):
        loaded = load(store, state, step=2, verify=verify)
        assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_version_1_checkpoint_is_deep_verified_before_loading(store):
    state = two_tensors()
    save(store, state)
    as_version_1(store)
    where = slices(store, 2)["a"]
    rewrite(store, where.file, flip(where.offset + 8), step=2)
    with pytest.raises(CorruptCheckpointError, match="failed verification") as info:
        load(store, state, step=2)
    assert any(p.startswith(f"{where.file}: crc32c") for p in info.value.problems)
    assert not torch.equal(load(store, state, step=2, verify=False)["a"], state["a"])


def test_damaged_metadata_checksums_are_refused_naming_the_metadata_file(store):
    # A crc32c field that is not a CRC: the metadata file itself is refused, before any read.
    state = two_tensors()
    save(store, state)
    reader = store.run(RUN).reader(1)
    body = json.loads(reader.read_bytes(METADATA))
    body["storage_data"][0]["crc32c"] = "not-a-crc"
    writer = store.run(RUN).begin(2)
    for name in reader.names:
        if name != METADATA:
            writer.write_bytes(name, reader.read_bytes(name))
    writer.write_bytes(METADATA, json.dumps(body).encode())
    writer.commit()
    with pytest.raises(CorruptCheckpointError, match="no valid crc32c") as info:
        load(store, state, step=2)
    assert METADATA in str(info.value)
