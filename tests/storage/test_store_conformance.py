"""The storage conformance suite: every test runs unchanged on local disk, memory://, S3 (moto's
server) and GCS (gcp-storage-emulator), through the ``backend`` fixture in tests/conftest.py."""

from __future__ import annotations

import io
import json
import os
import socket

import pytest

from tests.conftest import backends_with, random_payload
from zephon import storage
from zephon.storage import (
    CheckpointNotFoundError,
    CheckpointStore,
    CommitConflictError,
    CorruptCheckpointError,
    FileEntry,
    InvalidNameError,
    WriteAbortedError,
)
from zephon.storage.checksum import crc32c_of


@pytest.fixture
def store(backend):
    with backend.open_store(part_size=5 << 20) as s:
        yield s


def save(store: CheckpointStore, run, step, files: dict[str, bytes], **meta) -> storage.Manifest:
    with store.run(run).begin(step, metadata=meta or None) as writer:
        writer.write_many(files)
        return writer.commit()


def raw_fs(store):
    return store.location.fs


def test_round_trip_records_every_file_with_size_and_crc32c(store, tmp_path):
    local = tmp_path / "local.bin"
    local.write_bytes(b"from a local file" * 100)
    with store.run("run-a").begin(10, metadata={"loss": 1.5}) as writer:
        writer.write_bytes("model/weights.bin", b"\x00\x01" * 1000)
        writer.write_stream("data/position.json", io.BytesIO(b'{"lane": 3}'))
        writer.put_file("local.bin", str(local))
        with writer.open("streamed.bin") as out:
            out.write(b"part one;")
            out.write(memoryview(b"part two"))
        manifest = writer.commit(metadata={"extra": True})

    expected = {
        "model/weights.bin": b"\x00\x01" * 1000,
        "data/position.json": b'{"lane": 3}',
        "local.bin": local.read_bytes(),
        "streamed.bin": b"part one;part two",
    }
    assert manifest.run == "run-a" and manifest.step == 10
    assert manifest.format_version == storage.manifest.PLAIN_FORMAT_VERSION
    assert {f.name: (f.size, f.crc32c) for f in manifest.files} == {
        name: (len(data), crc32c_of(data)) for name, data in expected.items()
    }
    assert manifest.total_bytes == sum(len(d) for d in expected.values())
    assert manifest.writer == {"host": socket.gethostname(), "pid": os.getpid()}
    assert manifest.metadata == {"loss": 1.5, "extra": True}
    assert manifest.save_id.startswith("e0-") and manifest.payload == manifest.save_id
    assert manifest.epoch == 0 and manifest.created_at <= manifest.committed_at

    reread = store.run("run-a").read_manifest(10)
    assert reread == manifest
    reader = store.run("run-a").reader(10)
    for name, data in expected.items():
        assert reader.read_bytes(name) == data
        with reader.open(name) as handle:
            assert handle.read() == data
    reader.get_file("local.bin", tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == expected["local.bin"]


def test_marker_holds_the_documented_json_fields(store):
    save(store, "r", 1, {"a": b"xyz"}, note="hi")
    marker = f"{store.run('r').checkpoint_path(1)}/_COMMIT"
    body = json.loads(raw_fs(store).cat_file(marker))
    assert body["format_version"] == 2
    assert body["run"] == "r" and body["step"] == 1
    assert body["epoch"] == 0 and body["payload"] == body["save_id"]
    assert body["files"] == [{"name": "a", "size": 3, "crc32c": crc32c_of(b"xyz")}]
    assert body["total_bytes"] == 3 and body["file_count"] == 1
    assert set(body["writer"]) == {"host", "pid"}
    assert body["metadata"] == {"note": "hi"}
    assert body["save_id"] and body["created_at"] and body["committed_at"]


def test_inference_layout_saves_directly_under_the_root(store):
    save(store, None, 7, {"out.jsonl": b"{}"})
    assert store.run(None).checkpoint_path(7) == f"{store.location.root}/save-7"
    assert store.run(None).committed_steps() == [7]
    assert store.run(None).read_manifest(7).run is None


def test_only_committed_steps_are_listed_and_latest_is_the_newest(store):
    for step in (5, 100, 20):
        save(store, "r", step, {"x": b"1"})
    pending = store.run("r").begin(300)
    pending.write_bytes("x", b"never committed")
    assert store.run("r").committed_steps() == [5, 20, 100]
    assert store.run("r").latest_step() == 100
    assert [(s.step, s.committed) for s in store.run("r").list_steps()] == [
        (5, True),
        (20, True),
        (100, True),
        (300, False),
    ]
    assert store.run("other-run").latest_step() is None
    assert store.run("other-run").committed_steps() == []


def test_latest_skips_a_marker_that_does_not_parse(store):
    save(store, "r", 1, {"x": b"1"})
    save(store, "r", 2, {"x": b"2"})
    raw_fs(store).pipe_file(f"{store.run('r').checkpoint_path(2)}/_COMMIT", b"{not json")
    assert store.run("r").latest_step() == 1
    with pytest.raises(CorruptCheckpointError, match="save-2/_COMMIT.*not a valid manifest"):
        store.run("r").read_manifest(2)


def test_committing_a_committed_step_raises_and_never_overwrites(store):
    first = save(store, "r", 3, {"x": b"first"})
    with pytest.raises(CommitConflictError, match=r"save-3 is already committed \(by "):
        store.run("r").begin(3)
    assert store.run("r").read_manifest(3) == first
    assert store.run("r").reader(3).read_bytes("x") == b"first"


def test_second_commit_of_the_same_writer_is_refused(store):
    writer = store.run("r").begin(1)
    writer.write_bytes("x", b"1")
    writer.commit()
    with pytest.raises(WriteAbortedError, match="is committed"):
        writer.commit()
    with pytest.raises(WriteAbortedError):
        writer.write_bytes("y", b"2")


def test_the_marker_is_the_only_create_only_write(store, backend):
    save(store, "r", 1, {"a": b"1", "b": b"2"})
    if backend.name == "gcs":
        # The emulator ignores ifGenerationMatch, so check the request carried it: exactly one
        # create-only upload (the marker), none for the payload.
        assert len(backend.create_only_requests()) == 1
    with pytest.raises(CommitConflictError):
        store.run("r").begin(1)


@pytest.fixture(params=backends_with(one_winner_races=True))
def exclusive_store(request, tmp_path):
    """Backends whose server enforces create-only writes (the GCS emulator does not; the test
    above checks that the GCS request carries the precondition)."""
    from tests.conftest import make_backend

    b = make_backend(request.param, request, tmp_path)
    with b.open_store() as s:
        yield s


def test_a_commit_that_loses_to_another_raises_commit_conflict(exclusive_store):
    store = exclusive_store
    loser = store.run("r").begin(4)
    loser.write_bytes("loser.bin", b"L")
    winner = store.run("r").attach(4, save_id="w" * 32)
    # The winner is a second primary in another process in real life; here the attached
    # writer's entries are committed by a fresh primary made without begin's marker checks.
    winner.write_bytes("winner.bin", b"W")
    won = storage.CheckpointWriter(
        store.location,
        store.run("r").layout,
        4,
        "w" * 32,
        primary=True,
        part_size=store.part_size,
        executor=store.executor,
    )
    won.add_entries(winner.entries)
    won.commit()
    with pytest.raises(CommitConflictError, match="already committed"):
        loser.commit()
    loser.abort()  # removes only the loser's own file
    assert store.run("r").verify(4, deep=True).ok
    assert [f.name for f in store.run("r").read_manifest(4).files] == ["winner.bin"]


def test_abort_removes_everything_written(store):
    writer = store.run("r").begin(2)
    writer.write_many({f"f{i}": b"x" * i for i in range(5)})
    writer.abort()
    assert store.run("r").list_steps() == []


def test_an_exception_inside_the_writer_block_aborts(store):
    with pytest.raises(RuntimeError, match="boom"), store.run("r").begin(2) as writer:
        writer.write_bytes("x", b"1")
        raise RuntimeError("boom")
    assert store.run("r").list_steps() == []


def test_a_crashed_save_never_shares_files_with_the_next_save_of_the_step(store):
    crashed = store.run("r").begin(9)
    crashed.write_many({"old-a": b"a", "nested/old-b": b"b"})
    # the crashed save never commits or aborts; the next one writes a directory of its own
    manifest = save(store, "r", 9, {"new": b"n"})
    assert [f.name for f in manifest.files] == ["new"]
    listed = sorted(f.path.rsplit("save-9/", 1)[1] for f in _files(store, "r", 9))
    assert listed == sorted(
        ["_COMMIT", f"{manifest.save_id}/new", f"{crashed.save_id}/old-a"]
        + [f"{crashed.save_id}/nested/old-b"]
    )
    # gc finds the crashed save's directory as a leftover, never the committed one
    assert [o.save_id for o in store.orphans(0, runs=["r"])] == [crashed.save_id]
    store.remove_orphan(store.orphans(0, runs=["r"])[0])
    assert store.orphans(0, runs=["r"]) == []
    assert store.run("r").verify(9, deep=True).ok


def test_parallel_writes_record_every_file(store):
    files = {f"shard-{i:02d}.bin": random_payload(1000 + i) for i in range(32)}
    manifest = save(store, "r", 1, files)
    assert manifest.file_count == 32
    assert store.run("r").verify(1, deep=True).ok


def test_secondary_writers_entries_are_committed_by_the_primary(store):
    primary = store.run("r").begin(8)
    primary.write_bytes("rank0.bin", b"zero")
    secondary = store.run("r").attach(8, save_id=primary.save_id)
    secondary.write_bytes("rank1.bin", b"one")
    with pytest.raises(WriteAbortedError, match="only the primary writer"):
        secondary.commit()
    primary.add_entries(secondary.entries)
    manifest = primary.commit()
    assert [f.name for f in manifest.files] == ["rank0.bin", "rank1.bin"]
    assert store.run("r").verify(8, deep=True).ok


def test_conflicting_entries_for_one_name_are_refused(store):
    primary = store.run("r").begin(8)
    primary.write_bytes("same.bin", b"one")
    with pytest.raises(InvalidNameError, match="reported twice"):
        primary.add_entries([FileEntry("same.bin", 3, crc32c_of(b"two"))])


def test_commit_refuses_when_a_written_file_vanished(store):
    writer = store.run("r").begin(5)
    writer.write_many({"kept": b"k", "gone": b"g"})
    raw_fs(store).rm_file(f"{writer.payload_path}/gone")
    with pytest.raises(WriteAbortedError, match=r"gone: missing"):
        writer.commit()
    assert store.run("r").committed_steps() == []


def test_verify_finds_a_flipped_byte_a_truncated_and_a_missing_file_by_name(store):
    files = {"flipped": b"abcdefgh", "truncated": b"0123456789", "missing": b"m", "fine": b"ok"}
    save(store, "r", 1, files)
    assert store.run("r").verify(1).ok and store.run("r").verify(1, deep=True).ok
    base = store.run("r").reader(1).path
    fs = raw_fs(store)
    fs.pipe_file(f"{base}/flipped", b"abcdefgX")
    fs.pipe_file(f"{base}/truncated", b"01234")
    fs.rm_file(f"{base}/missing")

    shallow = store.run("r").verify(1)
    assert {(p.name, p.kind) for p in shallow.problems} == {
        ("truncated", "size"),
        ("missing", "missing"),
    }
    deep = store.run("r").verify(1, deep=True)
    assert {(p.name, p.kind) for p in deep.problems} == {
        ("flipped", "checksum"),
        ("truncated", "size"),
        ("missing", "missing"),
    }
    with pytest.raises(CorruptCheckpointError) as info:
        deep.raise_for_problems()
    message = str(info.value)
    assert "flipped" in message and "truncated" in message and "missing" in message
    assert "save-1" in message


def test_reading_a_missing_file_of_a_committed_checkpoint_is_corruption(store):
    save(store, "r", 1, {"a": b"1"})
    raw_fs(store).rm_file(f"{store.run('r').reader(1).path}/a")
    with pytest.raises(CorruptCheckpointError, match="a of committed checkpoint .* is missing"):
        store.run("r").reader(1).read_bytes("a")
    with pytest.raises(CheckpointNotFoundError, match="'b' is not a file of checkpoint"):
        store.run("r").reader(1).read_bytes("b")


def test_reading_an_uncommitted_step_is_not_found(store):
    writer = store.run("r").begin(1)
    writer.write_bytes("a", b"1")
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        store.run("r").read_manifest(1)


def test_delete_removes_marker_payload_and_directory_and_is_idempotent(store):
    save(store, "r", 1, {f"f{i}": b"x" for i in range(10)})
    save(store, "r", 2, {"keep": b"k"})
    assert store.run("r").delete(1) == 10
    assert store.run("r").committed_steps() == [2]
    assert _files(store, "r", 1) == []
    assert store.run("r").delete(1) == 0
    assert store.run("r").verify(2, deep=True).ok


def test_delete_finishes_what_a_crashed_delete_left(store):
    save(store, "r", 1, {f"f{i}": b"x" for i in range(4)})
    # a delete that crashed right after removing the marker
    raw_fs(store).rm_file(f"{store.run('r').checkpoint_path(1)}/_COMMIT")
    assert store.run("r").committed_steps() == []
    assert [o.step for o in store.orphans(0)] == [1]
    assert store.run("r").delete(1) == 4
    assert store.run("r").list_steps() == []


def test_orphans_are_uncommitted_directories_older_than_the_grace_period(store):
    save(store, "r", 1, {"a": b"1"})
    stale = store.run("r").begin(2)
    stale.write_bytes("a", b"1")
    other_run = store.run("q").begin(5)
    other_run.write_bytes("a", b"1")
    inference = store.run(None).begin(3)
    inference.write_bytes("a", b"1")
    import time

    future = time.time() + 3600
    found = {(o.run, o.step) for o in store.orphans(600, now=future)}
    assert found == {("r", 2), ("q", 5), (None, 3)}
    assert store.orphans(600) == []  # all younger than 10 minutes right now
    assert {(o.run, o.step) for o in store.orphans(600, runs=["r"], now=future)} == {("r", 2)}
    assert all(o.age_s >= 3000 for o in store.orphans(600, now=future))


def test_runs_lists_valid_run_directories(store):
    save(store, "alpha", 1, {"a": b"1"})
    save(store, "beta.2", 1, {"a": b"1"})
    save(store, None, 1, {"a": b"1"})
    assert store.runs() == ["alpha", "beta.2"]
    assert store.has_inference_layout()


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "a/b", "../escape", "a b", "x" * 129, "run\n", "ü", "save-12", "a\\b", "~"],
)
def test_hostile_run_names_are_refused_before_touching_storage(store, name):
    with pytest.raises(InvalidNameError, match="invalid run name|must be a string"):
        store.run(name).begin(1)
    with pytest.raises(InvalidNameError):
        store.run(name).committed_steps()
    assert store.runs() == []


@pytest.mark.parametrize("step", [-1, 1.5, "3", True, None])
def test_invalid_steps_are_refused(store, step):
    with pytest.raises(InvalidNameError, match="invalid step"):
        store.run("r").begin(step)


@pytest.mark.parametrize("name", ["/abs", "a/../b", "", "a//b", "_COMMIT", "_COMMIT.tmp-1", "./a"])
def test_hostile_file_names_are_refused(store, name):
    writer = store.run("r").begin(1)
    with pytest.raises(InvalidNameError, match="invalid checkpoint file name"):
        writer.write_bytes(name, b"x")


def test_a_name_is_written_once(store):
    writer = store.run("r").begin(1)
    writer.write_bytes("a", b"1")
    with pytest.raises(InvalidNameError, match="already written"):
        writer.write_bytes("a", b"2")


def test_large_files_upload_in_parts_and_verify(store, backend):
    data = random_payload(11 << 20)  # more than two 5 MiB parts: multipart on S3 and GCS
    with store.run("r").begin(1) as writer:
        writer.write_bytes("big.bin", data)
        with writer.open("big-streamed.bin") as out:
            for start in range(0, len(data), 1 << 20):
                out.write(data[start : start + (1 << 20)])
        writer.commit()
    report = store.run("r").verify(1, deep=True)
    assert report.ok and report.bytes_checked == 2 * len(data)
    if backend.name == "s3":  # a multipart upload's ETag is "<md5 of part md5s>-<parts>"
        for name in ("big.bin", "big-streamed.bin"):
            info = store.location.fs.info(f"{store.run('r').reader(1).path}/{name}", refresh=True)
            assert info["ETag"].strip('"').endswith("-3"), (name, info["ETag"])
    assert store.run("r").reader(1).read_bytes("big.bin") == data


def _files(store, run, step):
    from zephon.storage.backend import list_files

    return list_files(store.location, store.run(run).checkpoint_path(step))


def test_delete_many_removes_every_marker_before_any_payload(store):
    for step in range(4):
        save(store, "r", step, {f"f{i}": b"x" for i in range(3)})
    assert store.run("r").delete_many([0, 1, 2]) == {0: 3, 1: 3, 2: 3}
    assert [s.step for s in store.run("r").list_steps()] == [3]
    assert store.run("r").verify(3, deep=True).ok
    assert store.run("r").delete_many([0, 1]) == {0: 0, 1: 0}
    assert store.run("r").delete_many([]) == {}
    save(store, None, 1, {"a": b"1"})
    save(store, None, 2, {"a": b"1"})
    assert store.run(None).delete_many([1, 2]) == {1: 1, 2: 1}
    assert store.run(None).list_steps() == []
