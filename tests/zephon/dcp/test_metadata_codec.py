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

from zephon.dcp import MetadataEncodingError, ShardSlice, decode_metadata, encode_metadata
from zephon.dcp.metadata_codec import FORMAT_VERSION
from zephon.storage import CorruptCheckpointError
from zephon.storage.checksum import encode_crc32c

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
            "__1_0.distcp", 64, 36, "raw", "float32", (3, 3), crc32c="3q2+7w=="
        ),
        MetadataIndex("scalar", [], 0): ShardSlice(
            "__0_0.distcp", 0, 8, "raw", "float64", (), crc32c="AAAAAA=="
        ),
        MetadataIndex("optim.param_groups"): ShardSlice(
            "__0_1.distcp", 8, 120, "bytes", crc32c=encode_crc32c(0xFFFFFFFF)
        ),
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
        (lambda b: b.update(format_version=0), "never written"),
        (lambda b: b["storage_data"][0].pop("crc32c"), "no valid crc32c"),
        (lambda b: b["storage_data"][0].update(crc32c=None), "no valid crc32c"),
        (lambda b: b["storage_data"][0].update(crc32c=12345), "no valid crc32c"),
        (lambda b: b["storage_data"][0].update(crc32c="3q2+7w="), "no valid crc32c"),
        (lambda b: b["storage_data"][0].update(crc32c="3q2+7w==AAAA"), "no valid crc32c"),
        (lambda b: b["storage_data"][0].update(crc32c="3q2+7!=="), "no valid crc32c"),
        (lambda b: b["storage_data"][0].update(crc32c="3q2+7x=="), "no valid crc32c"),
    ],
)
def test_damaged_metadata_is_refused_naming_the_file(edit, expected):
    body = json.loads(encode_metadata(sample()))
    edit(body)
    with pytest.raises(CorruptCheckpointError, match=expected) as info:
        decode_metadata(json.dumps(body).encode(), where="s3://b/r/save-1/dcp_metadata.json")
    assert "s3://b/r/save-1/dcp_metadata.json" in str(info.value)


def version_1(body: dict) -> dict:
    """What Zephon's first format wrote: the same body without per-slice checksums."""
    body["format_version"] = 1
    for entry in body["storage_data"]:
        del entry["crc32c"]
    return body


def test_version_1_metadata_still_decodes_with_slices_without_checksums():
    body = version_1(json.loads(encode_metadata(sample())))
    decoded = decode_metadata(json.dumps(body).encode(), where="x")
    assert decoded.state_dict_metadata == sample().state_dict_metadata
    assert {where.crc32c for where in decoded.storage_data.values()} == {None}
    assert {i.fqn: (w.file, w.offset, w.length) for i, w in decoded.storage_data.items()} == {
        i.fqn: (w.file, w.offset, w.length) for i, w in sample().storage_data.items()
    }


def test_a_version_1_slice_claiming_a_checksum_is_refused():
    body = version_1(json.loads(encode_metadata(sample())))
    body["storage_data"][0]["crc32c"] = "AAAAAA=="
    with pytest.raises(CorruptCheckpointError, match="format version 1 does not have"):
        decode_metadata(json.dumps(body).encode(), where="x")


def test_every_slice_records_its_checksum_in_the_current_format():
    body = json.loads(encode_metadata(sample()))
    assert FORMAT_VERSION == 2
    assert [e["crc32c"] for e in body["storage_data"]] == ["3q2+7w==", "AAAAAA==", "/////w=="]


def test_a_slice_without_a_checksum_is_refused_at_save_time():
    metadata = sample()
    index = next(iter(metadata.storage_data))
    where = metadata.storage_data[index]
    metadata.storage_data[index] = ShardSlice(where.file, where.offset, where.length, "bytes")
    with pytest.raises(MetadataEncodingError, match="crc32c None"):
        encode_metadata(metadata)
