"""Datasets from memory and from JSONL / Parquet files on local disk and S3 (moto)."""

from __future__ import annotations

import io
import json

import fsspec
import pytest

import zephon
from storage.errors import StorageError
from zephon.errors import ConfigError
from zephon.pipeline import DataSourceError


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet(rows) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


def _write_shards(url: str, storage_options: dict) -> dict[str, list[dict]]:
    """Three shards: two JSONL (one in a sub-directory), one Parquet, plus a file to ignore."""
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    shards = {
        "a.jsonl": [{"id": i, "text": f"a{i}"} for i in range(7)],
        "sub/b.jsonl": [{"id": 100 + i, "text": f"b{i}"} for i in range(5)],
        "c.parquet": [{"id": 200 + i, "text": f"c{i}"} for i in range(9)],
    }
    for name, rows in shards.items():
        data = _parquet(rows) if name.endswith(".parquet") else _jsonl(rows)
        fs.makedirs(f"{root}/{name}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{root}/{name}", data)
    fs.pipe_file(f"{root}/README.txt", b"not a shard")
    return shards


def _check_dataset(dataset: zephon.Dataset, shards: dict[str, list[dict]]) -> None:
    assert sorted(dataset.shards) == sorted(shards)
    assert len(dataset) == 21
    source = zephon.StaticMixtureWorkSource(dataset, chunk_size=4, seed=2)
    records = [r for b in zephon.Pipeline(source).batch(3, drop_last=False) for r in b]
    assert sorted(r.payload["id"] for r in records) == sorted(
        row["id"] for rows in shards.values() for row in rows
    )
    for r in records:
        shard_id, _, row = r.sample_id.split("/", 1)[1].rpartition("/")
        assert shards[shard_id][int(row)] == r.payload


def test_from_dict_keeps_shards_in_sorted_order():
    ds = zephon.Dataset.from_dict(
        "d", {"b": zephon.InMemoryShard([1]), "a": zephon.InMemoryShard([2, 3])}
    )
    assert list(ds.shards) == ["a", "b"] and len(ds) == 3


def test_from_path_reads_jsonl_and_parquet_on_local_disk(tmp_path):
    shards = _write_shards(str(tmp_path / "data"), {})
    _check_dataset(zephon.Dataset.from_path("local", str(tmp_path / "data")), shards)


def test_from_path_reads_jsonl_and_parquet_on_s3(s3_backend):
    shards = _write_shards(s3_backend.url, s3_backend.storage_options)
    dataset = zephon.Dataset.from_path("s3data", s3_backend.url, s3_backend.storage_options)
    _check_dataset(dataset, shards)


def test_from_path_accepts_a_single_file(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_bytes(_jsonl([{"x": 1}, {"x": 2}]))
    dataset = zephon.Dataset.from_path("one", str(path))
    assert list(dataset.shards) == ["one.jsonl"] and len(dataset) == 2


def test_from_path_accepts_a_glob(tmp_path):
    shards = _write_shards(str(tmp_path / "data"), {})
    dataset = zephon.Dataset.from_path("glob", str(tmp_path / "data" / "*.jsonl"))
    assert list(dataset.shards) == ["a.jsonl"] and len(dataset) == len(shards["a.jsonl"])


def test_format_forces_a_reader_for_files_without_a_known_suffix(tmp_path):
    (tmp_path / "part-0").write_bytes(_jsonl([{"x": 1}]))
    dataset = zephon.Dataset.from_path("forced", str(tmp_path), format="jsonl")
    assert list(dataset.shards) == ["part-0"]


def test_a_missing_path_is_an_error_naming_the_url(tmp_path):
    with pytest.raises(DataSourceError, match="nothing at .*/missing"):
        zephon.Dataset.from_path("m", str(tmp_path / "missing"))


def test_a_directory_without_shards_is_an_error_saying_what_was_looked_for(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataSourceError, match=r"no \.jsonl or \.parquet files"):
        zephon.Dataset.from_path("e", str(tmp_path))


def test_a_bad_jsonl_line_is_an_error_naming_the_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"x": 1}\n{oops\n')
    dataset = zephon.Dataset.from_path("bad", str(tmp_path))
    with pytest.raises(DataSourceError, match=r"bad\.jsonl line 2 is not valid JSON"):
        len(dataset)


def test_urls_are_resolved_by_the_storage_layer_and_secrets_are_masked():
    with pytest.raises(StorageError) as info:
        zephon.Dataset.from_path("x", "s3://user:hunter2@::chained")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "name,shards,match",
    [
        ("bad name", {"a": zephon.InMemoryShard([1])}, "Dataset name must be"),
        ("ok", {}, "needs at least one shard"),
        ("ok", {"a": [1, 2]}, "must be a shard"),
    ],
)
def test_invalid_datasets_are_refused_with_the_reason(name, shards, match):
    with pytest.raises(ConfigError, match=match):
        zephon.Dataset.from_dict(name, shards)
