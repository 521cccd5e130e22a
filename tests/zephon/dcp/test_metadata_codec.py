"""DCP metadata as versioned JSON: round trips, refusals, and no unpickling."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from storage import CorruptCheckpointError
from zephon.dcp import MetadataEncodingError, ShardSlice, decode_metadata, encode_metadata
from zephon.dcp.metadata_codec import FORMAT_VERSION

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.bool,
    torch.int64,
    torch.uint8,
    torch.complex64,
    torch.float8_e4m3fn,
]


def tensor_md(dtype: torch.dtype, size: list[int], chunks: list[tuple[list, list]]):
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


def sample() -> Metadata:
    state = {f"t.{d}": tensor_md(d, [4, 2], [([0, 0], [4, 2])]) for d in DTYPES}
    state["scalar"] = tensor_md(torch.float64, [], [([], [])])
    state["sharded"] = tensor_md(torch.float32, [6, 3], [([0, 0], [3, 3]), ([3, 0], [3, 3])])
    state["optim.param_groups"] = BytesStorageMetadata()
    storage = {
        MetadataIndex("sharded", [3, 0], 1): ShardSlice(
            "__1_0.distcp", 64, 36, "raw", "float32", (3, 3)
        ),
        MetadataIndex("scalar", [], 0): ShardSlice("__0_0.distcp", 0, 8, "raw", "float64", ()),
        MetadataIndex("optim.param_groups"): ShardSlice("__0_1.distcp", 8, 120, "bytes"),
    }
    return Metadata(
        state_dict_metadata=state,
        planner_data={"optim.state.0.exp_avg": ("optim", "state", 0, "exp_avg")},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id="s3://b/r/save-1", save_id="abc", modules=["m"]),
        version="1.0.0",
    )


def test_metadata_round_trips_through_json():
    original = sample()
    decoded = decode_metadata(encode_metadata(original), where="x")
    assert decoded.state_dict_metadata == original.state_dict_metadata
    assert decoded.planner_data == original.planner_data
    assert decoded.storage_meta == original.storage_meta
    assert decoded.version == "1.0.0"
    assert decoded.storage_data == original.storage_data
    # MetadataIndex ignores the index hint in ==; it must survive anyway
    hints = {i.fqn: i.index for i in decoded.storage_data}
    assert hints == {"sharded": 1, "scalar": 0, "optim.param_groups": None}


def test_encoded_metadata_is_plain_json_naming_dtypes():
    data = encode_metadata(sample())
    body = json.loads(data)
    assert body["format_version"] == FORMAT_VERSION
    assert body["state_dict_metadata"]["t.torch.bfloat16"]["dtype"] == "bfloat16"
    assert body["state_dict_metadata"]["t.torch.float32"]["memory_format"] == "contiguous_format"
    assert b"\x80" not in data


def test_planner_data_that_is_not_json_is_refused_naming_the_field():
    metadata = sample()
    metadata.planner_data = {"a": {1, 2}}
    with pytest.raises(MetadataEncodingError, match="planner_data"):
        encode_metadata(metadata)


def test_storage_data_from_another_writer_is_refused():
    metadata = sample()
    metadata.storage_data = {MetadataIndex("x"): object()}
    with pytest.raises(MetadataEncodingError, match="ZephonStorageWriter"):
        encode_metadata(metadata)


def test_a_pickled_metadata_file_is_refused_without_unpickling(monkeypatch):
    def forbidden(*_a, **_k):
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    data = pickle.dumps(sample())
    with pytest.raises(CorruptCheckpointError, match="ckpt/dcp_metadata.json"):
        decode_metadata(data, where="ckpt/dcp_metadata.json")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda b: b.update(format_version=FORMAT_VERSION + 1), "upgrade Zephon"),
        (lambda b: b.update(format="something-else"), "not a zephon-dcp-metadata file"),
        (lambda b: b.update(byteorder="big" if b["byteorder"] == "little" else "little"), "endian"),
        (
            lambda b: b["state_dict_metadata"]["scalar"].update(dtype="no_such_dtype"),
            "unknown dtype",
        ),
        (lambda b: b["storage_data"][0].update(encoding="zip"), "unknown encoding"),
        (lambda b: b["storage_data"][0].update(length=-1), "negative"),
    ],
)
def test_damaged_metadata_is_refused_naming_the_file(edit, expected):
    body = json.loads(encode_metadata(sample()))
    edit(body)
    with pytest.raises(CorruptCheckpointError, match=expected) as info:
        decode_metadata(json.dumps(body).encode(), where="s3://b/r/save-1/dcp_metadata.json")
    assert "s3://b/r/save-1/dcp_metadata.json" in str(info.value)
