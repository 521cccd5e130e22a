"""Deduplicated files in the storage layer (docs/dedup.md): chunk instances written against a
base, read back by any range, verified, refused when hostile, and swept by the rule: never a
chunk a marker references, a stale attempt's at once, a finished save's at once, anything
else only after the grace. On every backend."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.storage import CheckpointStore, CorruptCheckpointError, Manifest, WriteAbortedError
from zephon.storage.chunks import ChunkRef, parse_chunk_name

KIB = 1 << 10


def start(store: CheckpointStore, run: str = "r"):
    handle = store.run(run)
    fence = handle.decide_resume(handle.claim_attempt(after=handle.lineage()), resumed_from=None)
    return handle, fence


def save(run, fence, step: int, pieces: list[bytes], base: Manifest | None, max_chunk=16 * KIB):
    with run.begin(step, fence=fence) as writer:
        writer.deduplicate(
            {c.sha256: c for c in base.chunk_refs()} if base else {}, max_chunk=max_chunk
        )
        with writer.open_chunked("shard.bin") as out:
            for piece in pieces:
                out.write(piece, in_place=True)
        return writer.commit(files={"meta.json": b"{}"})


def chunk_names(store: CheckpointStore, run: str = "r") -> set[str]:
    layout = store.run(run).layout
    return {f.path.rsplit("/", 1)[-1] for f in store.location.backend.list_files(layout.chunk_dir)}


@pytest.fixture
def store(backend):
    with backend.open_store() as opened:
        yield opened


def test_a_save_uploads_only_what_its_base_lacks_and_reads_back_by_any_range(store):
    run, fence = start(store)
    same, changed = os.urandom(40 * KIB), os.urandom(3 * KIB)
    first = save(run, fence, 1, [same, changed], None)
    second = save(run, fence, 2, [same, os.urandom(3 * KIB)], first)
    assert first.format_version == 3 and first.new_bytes == first.total_bytes
    assert second.new_bytes == 3 * KIB + 2  # the changed piece and meta.json
    assert [c.save_id for c in second.file("shard.bin").chunks][:3] == [first.save_id] * 3
    data = run.reader(2).read_bytes("shard.bin")
    assert data[: len(same)] == same
    reader = run.reader(2)
    for lo, hi in [(0, 1), (16 * KIB - 1, 16 * KIB + 1), (5, 43 * KIB), (40 * KIB, 50 * KIB)]:
        assert reader.read_range("shard.bin", lo, hi) == data[lo:hi]
        buffer = bytearray(hi - lo)
        assert reader.read_range_into("shard.bin", lo, buffer) == min(hi, len(data)) - lo
        assert bytes(buffer[: min(hi, len(data)) - lo]) == data[lo:hi]
    with reader.open("shard.bin") as handle:
        handle.seek(17 * KIB)
        assert handle.read(10 * KIB) == data[17 * KIB : 27 * KIB]
    assert reader.local_path("shard.bin") is None  # never read in place: it is not one file
    run.verify(2, deep=True).raise_for_problems()


def test_identical_pieces_of_one_save_are_uploaded_once(store):
    run, fence = start(store)
    zeros = bytes(16 * KIB)
    manifest = save(run, fence, 1, [zeros, zeros, zeros], None)
    assert len({c.name for c in manifest.chunk_refs()}) == 1
    assert len(chunk_names(store)) == 1
    assert run.reader(1).read_bytes("shard.bin") == zeros * 3


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    cap=st.integers(1, 4096),
    lo=st.integers(0, 30000),
    length=st.integers(0, 30000),
)
def test_any_range_of_any_cut_reads_the_bytes_written(sizes, cap, lo, length):
    with CheckpointStore(f"memory://zephon-chunks-{os.urandom(6).hex()}") as store:
        run, fence = start(store)
        pieces = [os.urandom(n) for n in sizes]
        save(run, fence, 1, pieces, None, max_chunk=cap)
        data = b"".join(pieces)
        reader = run.reader(1)
        assert reader.read_bytes("shard.bin") == data
        assert reader.read_range("shard.bin", lo, lo + length) == data[lo : lo + length]
        assert all(c.size <= cap for c in reader.manifest.chunk_refs())


def test_a_missing_or_damaged_chunk_is_damage_named_by_verify_and_by_a_read(store, backend):
    run, fence = start(store)
    manifest = save(run, fence, 1, [os.urandom(40 * KIB)], None)
    chunk = manifest.file("shard.bin").chunks[1]
    path = run.layout.chunk_path(chunk.name)
    store.location.backend.put_bytes(path, os.urandom(chunk.size), 8 << 20)
    report = run.verify(1, deep=True)
    assert [p.name for p in report.problems] == ["shard.bin"]
    assert chunk.name in report.problems[0].detail
    with pytest.raises(CorruptCheckpointError, match="shard.bin"):
        run.reader(1).read_bytes("shard.bin")
    store.location.backend.remove_files([path])
    assert chunk.name in str(run.verify(1).problems[0])
    with pytest.raises(CorruptCheckpointError, match="missing"):
        run.reader(1).read_bytes("shard.bin")


def test_hostile_chunk_references_are_refused_as_damage():
    def marker(chunks) -> bytes:
        body = {
            "format_version": 3,
            "run": "r",
            "step": 1,
            "save_id": "e1-abc",
            "epoch": 1,
            "payload": "e1-abc",
            "files": [{"name": "x", "size": 4, "crc32c": "AAAAAA==", "chunks": chunks}],
        }
        return json.dumps(body).encode()

    good = ["a" * 64, "e1-abc", 4, "AAAAAA=="]
    assert Manifest.from_json(marker([good]), where="m").file("x").chunks[0].size == 4
    for bad in (
        [["../../etc/passwd", "e1-abc", 4, "AAAAAA=="]],  # not a hash: no path in a name
        [["a" * 64, "../x", 4, "AAAAAA=="]],  # not a save id
        [["a" * 64, "e1-abc", 5, "AAAAAA=="]],  # sizes do not add up
        [["a" * 64, "e1-abc", 0, "AAAAAA=="]],  # an empty chunk
        [["a" * 64, "e1-abc", 4, "not-crc"]],
        ["a" * 64],
        "chunks",
    ):
        with pytest.raises(CorruptCheckpointError):
            Manifest.from_json(marker(bad), where="m")
    assert parse_chunk_name("a" * 64 + ".e1-abc") == ("a" * 64, "e1-abc")
    assert parse_chunk_name("a" * 64) is None and parse_chunk_name("x.e1-abc") is None


def test_a_plain_save_keeps_format_2_and_an_old_reader_refuses_format_3_by_name(store):
    run, fence = start(store)
    with run.begin(1, fence=fence) as writer:
        writer.write_bytes("a.bin", b"abc")
        assert writer.commit().format_version == 2
    ref = ChunkRef("b" * 64, "e1-x", 3, "AAAAAA==")
    assert ref.name == "b" * 64 + ".e1-x"


def test_the_sweep_keeps_referenced_and_young_chunks_and_removes_what_is_over(store):
    run, fence = start(store)
    base = os.urandom(32 * KIB)
    one = save(run, fence, 1, [base, b"one" * 100], None)
    two = save(run, fence, 2, [base, b"two" * 100], one)
    # a save that never committed left a chunk
    with run.begin(3, fence=fence) as writer:
        writer.deduplicate({})
        with writer.open_chunked("shard.bin") as out:
            out.write(b"orphan" * 100)
        orphan_save = writer.save_id
        writer._state = "failed"  # noqa: SLF001 - a writer killed before its commit or abort
    before = chunk_names(store)
    assert any(name.endswith(orphan_save) for name in before)
    run.delete(1)
    # nothing is over yet: step 1's own chunk is unreferenced but its save is not known over
    assert run.sweep_chunks(older_than_s=3600).removed == 0
    swept = run.sweep_chunks(older_than_s=3600, finished=[one.save_id])
    assert swept.removed == 1  # step 1's own "one" chunk; the base's chunks are step 2's too
    assert {c.name for c in two.chunk_refs()} <= chunk_names(store)
    # past the grace, the uncommitted save's chunk goes too
    assert run.sweep_chunks(older_than_s=0).removed == 1
    assert chunk_names(store) == {c.name for c in two.chunk_refs()}
    run.verify(2, deep=True).raise_for_problems()


def test_a_stale_attempts_unreferenced_chunks_go_at_once_and_never_the_current_ones(store):
    run, old = start(store)
    kept = save(run, old, 1, [os.urandom(20 * KIB)], None)  # history: the new attempt resumes
    with run.begin(2, fence=old) as writer:  # the old attempt's save in flight
        writer.deduplicate({})
        with writer.open_chunked("shard.bin") as out:
            out.write(b"stale" * 1000)
        writer._state = "failed"  # noqa: SLF001 - killed
    new = run.decide_resume(run.claim_attempt(after=run.lineage()), resumed_from=1)
    current = save(run, new, 2, [os.urandom(5 * KIB)], kept)
    with run.begin(3, fence=new) as writer:  # the current attempt's save in flight
        writer.deduplicate({})
        with writer.open_chunked("shard.bin") as out:
            out.write(b"live" * 1000)
        live = writer.save_id
        kept_names = {c.name for c in kept.chunk_refs()}
        stale = {n for n in chunk_names(store) if ".e1-" in n} - kept_names
        assert len(stale) == 1
        swept = run.sweep_chunks(older_than_s=3600)
        assert swept.removed_names == sorted(stale)
        names = chunk_names(store)
        assert any(name.endswith(live) for name in names)  # young, current: kept
        assert {c.name for c in kept.chunk_refs() + current.chunk_refs()} <= names
        writer._state = "failed"  # noqa: SLF001


def test_a_marker_that_cannot_be_read_stops_the_sweep(store):
    run, fence = start(store)
    save(run, fence, 1, [b"x" * 100], None)
    store.location.backend.make_dirs(run.layout.checkpoint_path(2))
    store.location.backend.put_bytes(run.layout.marker_path(2), b"{not json", 1 << 20)
    result = run.sweep_chunks(older_than_s=0)
    assert result.removed == 0 and "step 2" in (result.skipped or "")


def test_a_save_whose_base_was_deleted_meanwhile_is_not_committed(store):
    run, fence = start(store)
    base = save(run, fence, 1, [os.urandom(20 * KIB)], None)
    with run.begin(2, fence=fence) as writer:
        writer.deduplicate({c.sha256: c for c in base.chunk_refs()})
        writer.keep_base(base)
        with writer.open_chunked("shard.bin") as out:
            out.write(os.urandom(20 * KIB))
        run.delete(1)  # by hand, while the save runs
        with pytest.raises(WriteAbortedError, match="step 1"):
            writer.commit()
    assert run.committed_steps() == []
