"""Datasets from memory and from JSONL / Parquet files on local disk and S3 (moto)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import fsspec
import pytest

import zephon
from tests.zephon.doc_blocks import block
from zephon.errors import ConfigError
from zephon.pipeline import DataSourceError
from zephon.storage.errors import StorageError


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


# -- int shard ids (the Zephon data library's {0: shard}) -----------------------------------------


def _int_dataset(name: str = "d", keys=(10, 2, 0)) -> zephon.Dataset:
    return zephon.Dataset.from_dict(
        name, {k: zephon.InMemoryShard([{"shard": k, "row": r} for r in range(5)]) for k in keys}
    )


def test_int_shard_ids_are_accepted_and_sorted_as_numbers():
    dataset = _int_dataset()
    assert list(dataset.shards) == [0, 2, 10] and len(dataset) == 15


def test_int_shard_ids_give_a_pipeline_with_decimal_sample_ids():
    source = zephon.StaticMixtureWorkSource(_int_dataset(), chunk_size=4, seed=2)
    records = [r for b in zephon.Pipeline(source).batch(3, drop_last=False) for r in b]
    assert sorted(r.sample_id for r in records) == sorted(
        f"d/{k}/{row}" for k in (0, 2, 10) for row in range(5)
    )
    for r in records:  # each sample id names the record it delivered
        _, shard, row = r.sample_id.split("/")
        assert r.payload == {"shard": int(shard), "row": int(row)}


def test_numpy_integer_shard_ids_become_ints():
    np = pytest.importorskip("numpy")
    dataset = zephon.Dataset.from_dict("d", {np.int64(3): zephon.InMemoryShard([1])})
    assert list(dataset.shards) == [3] and type(next(iter(dataset.shards))) is int


def test_int_and_str_shard_ids_make_different_curricula():
    rows = zephon.InMemoryShard(list(range(5)))
    as_int = zephon.StaticMixtureWorkSource(zephon.Dataset.from_dict("d", {0: rows}))
    as_str = zephon.StaticMixtureWorkSource(zephon.Dataset.from_dict("d", {"0": rows}))
    assert as_int.fingerprint() != as_str.fingerprint()
    state = zephon.Pipeline(as_int).batch(2).checkpoint()
    with pytest.raises(zephon.PipelineStateError) as info:
        zephon.Pipeline(as_str).batch(2).restore(state)
    assert info.value.field == "work_source"


def test_the_curriculum_of_int_shard_ids_is_stable():
    # A literal digest: planning int-keyed datasets must not drift between versions or
    # machines, or every saved state of such a run would stop restoring.
    source = zephon.StaticMixtureWorkSource(_int_dataset(), chunk_size=4, seed=1)
    assert source.fingerprint() == "b88533e3b4d266dd"
    again = zephon.StaticMixtureWorkSource(_int_dataset(keys=(2, 0, 10)), chunk_size=4, seed=1)
    assert [again.chunk(k) for k in range(4)] == [source.chunk(k) for k in range(4)]


@pytest.mark.parametrize(
    "shards,match",
    [
        (
            {0: zephon.InMemoryShard([1]), "a": zephon.InMemoryShard([2])},
            r"shard ids must be all ints or all strings, got both \(0 and 'a'\)",
        ),
        ({True: zephon.InMemoryShard([1])}, "shard ids must be non-empty strings or ints"),
        ({"": zephon.InMemoryShard([1])}, "shard ids must be non-empty strings or ints"),
        ({1.5: zephon.InMemoryShard([1])}, "shard ids must be non-empty strings or ints, got 1.5"),
        ([zephon.InMemoryShard([1])], "shards must be a {shard_id: shard} mapping, got list"),
    ],
)
def test_invalid_shard_ids_are_refused_in_one_line(shards, match):
    with pytest.raises(ConfigError, match=match) as info:
        zephon.Dataset.from_dict("d", shards)
    assert "\n" not in str(info.value)


# -- from_path(name=, path=, fmt=) ----------------------------------------------------------------


def test_from_path_takes_the_keywords_name_path_fmt(tmp_path):
    (tmp_path / "part-0").write_bytes(_jsonl([{"x": 1}, {"x": 2}]))
    dataset = zephon.Dataset.from_path(name="kw", path=str(tmp_path), fmt="jsonl")
    assert dataset.name == "kw" and list(dataset.shards) == ["part-0"] and len(dataset) == 2
    # the existing spellings name the same thing
    same = zephon.Dataset.from_path("kw", url=str(tmp_path), format="jsonl")
    assert list(same.shards) == list(dataset.shards)


def test_from_path_keywords_reach_s3(s3_backend):
    shards = _write_shards(s3_backend.url, s3_backend.storage_options)
    dataset = zephon.Dataset.from_path(
        name="s3kw", path=s3_backend.url, storage_options=s3_backend.storage_options
    )
    assert sorted(dataset.shards) == sorted(shards)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, r"needs the data's location: pass url= \(or path=\)"),
        ({"url": "/a", "path": "/b"}, "give url= or path=, not both"),
        ({"path": "/a", "format": "jsonl", "fmt": "jsonl"}, "give format= or fmt=, not both"),
        ({"path": "/a", "fmt": "mds"}, r"format \(or fmt\) must be 'jsonl', 'parquet' or None"),
        ({"path": ""}, "must be a non-empty string"),
    ],
)
def test_from_path_argument_errors_name_the_parameter(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        zephon.Dataset.from_path(name="x", **kwargs)


@pytest.mark.slow
def test_a_process_that_read_parquet_shards_exits_cleanly_every_time(tmp_path):
    # pyarrow 26 dropping its last reference to a Python-backed source on its own thread
    # ended about 1 process in 20 in std::terminate at exit (5 of 200 runs of this example
    # with the source a bytes buffer; 8 of 20 with a file object); now 0 of 600. Thirty runs
    # catch a 1-in-20 failure 19 times in 20.
    pytest.importorskip("pyarrow")
    example = block("docs/pipeline.md", 11)
    assert "Dataset.from_path" in example.code and ".parquet" in example.code
    script = tmp_path / "example.py"
    script.write_text(example.code)
    for run in range(30):
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"run {run}: exit {done.returncode}: {done.stderr[-500:]}"
