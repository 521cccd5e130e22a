"""Fencing at the storage layer, on every backend: attempt records claimed exclusively, the
lineage rule that decides which markers are history, the re-check before the marker, markers
of abandoned histories superseded, condemned saves kept out of "latest", and manifests
validated as input."""

from __future__ import annotations

import json

import pytest

from zephon.storage import (
    CheckpointStore,
    CommitConflictError,
    CorruptCheckpointError,
    FencedOutError,
    Lineage,
)
from zephon.storage.checksum import crc32c_of
from zephon.storage.manifest import Manifest


@pytest.fixture
def store(backend):
    with backend.open_store() as s:
        yield s


def start(store: CheckpointStore, run: str, resumed_from: int | None):
    """A new attempt of ``run`` that resumes from ``resumed_from``, as a job start does it:
    claim the epoch, then decide."""
    fence = store.run(run).claim_attempt(after=store.run(run).lineage())
    return store.run(run).decide_resume(fence, resumed_from)


def save(store, run, step, fence, files=None):
    with store.run(run).begin(step, fence=fence) as writer:
        writer.write_many(files or {"w.bin": f"{run}-{step}-{fence.epoch}".encode()})
        return writer.commit()


def test_attempts_get_increasing_epochs_and_the_newest_is_current(store):
    assert store.run("r").lineage() == Lineage(None)
    first = start(store, "r", None)
    second = start(store, "r", None)
    assert (first.epoch, second.epoch) == (1, 2)
    assert store.run("r").lineage().current == second.record
    assert second.record.host and second.record.pid and second.record.started_at


def test_two_starts_claiming_the_same_epoch_have_one_winner(store, backend):
    seen = store.run("r").lineage()
    store.run("r").claim_attempt(after=seen)
    if not backend.enforces_exclusive_create:
        # The GCS emulator ignores preconditions: check the record's upload (the only write so
        # far) carried one.
        assert len(backend.create_only_requests()) == 1
        return
    with pytest.raises(FencedOutError, match=r"epoch 1 .* registered by another start"):
        store.run("r").claim_attempt(after=seen)
    assert store.run("r").lineage().epoch == 1


def test_an_attempt_abandons_nothing_until_it_decides_where_it_resumes(store):
    old = start(store, "r", None)
    for step in (40, 50):
        save(store, "r", step, old)
    claimed = store.run("r").claim_attempt(after=store.run("r").lineage())
    assert store.run("r").latest().step == 50  # nothing abandoned yet, but `old` is fenced
    with pytest.raises(FencedOutError):
        store.run("r").begin(60, fence=old)
    with pytest.raises(ValueError, match="has not decided where it resumes"):
        store.run("r").begin(60, fence=claimed)
    new = store.run("r").decide_resume(claimed, 40)
    assert store.run("r").latest().step == 40 and new.record.decided
    assert store.run("r").decide_resume(claimed, 40).record == new.record  # idempotent
    store.run("r").claim_attempt(after=store.run("r").lineage())
    with pytest.raises(FencedOutError, match="took over before it chose where to resume"):
        store.run("r").decide_resume(claimed, 40)


def test_a_stale_attempt_cannot_commit_once_a_newer_one_registered(store):
    old = start(store, "r", None)
    save(store, "r", 10, old)
    writer = store.run("r").begin(20, fence=old)
    writer.write_bytes("w.bin", b"late")
    new = start(store, "r", 10)
    with pytest.raises(FencedOutError) as caught:
        writer.commit()
    message = str(caught.value)
    assert f"attempt epoch {old.epoch} is no longer current" in message
    assert f"epoch {new.epoch} (host {new.record.host}, pid {new.record.pid}" in message
    assert caught.value.current.epoch == new.epoch
    assert not store.run("r").is_committed(20)
    with pytest.raises(FencedOutError):
        store.run("r").begin(30, fence=old)


def test_markers_above_the_new_resume_point_are_not_history(store):
    old = start(store, "r", None)
    for step in (40, 50, 60):
        save(store, "r", step, old)
    new = start(store, "r", 40)
    lineage = store.run("r").lineage()
    assert lineage.admits(old.epoch, 40) and not lineage.admits(old.epoch, 50)
    assert store.run("r").latest().step == 40
    assert [m.step for m in store.run("r").complete()] == [40]
    assert "abandoned" in lineage.why_not(old.epoch, 60)
    # ... and stay out after a later start resumes from the new attempt's own checkpoint
    save(store, "r", 45, new)
    third = start(store, "r", 45)
    assert [m.step for m in store.run("r").complete()] == [40, 45]
    assert store.run("r").lineage().admits(third.epoch, 10**9)


def test_a_fresh_start_abandons_every_older_checkpoint(store):
    old = start(store, "r", None)
    save(store, "r", 10, old)
    start(store, "r", None)
    assert store.run("r").latest() is None


def test_the_current_attempt_supersedes_a_marker_of_an_abandoned_history(store):
    old = start(store, "r", None)
    save(store, "r", 40, old)
    stale = save(store, "r", 50, old)
    new = start(store, "r", 40)
    mine = save(store, "r", 50, new, {"w.bin": b"new weights"})
    assert store.run("r").read_manifest(50).save_id == mine.save_id != stale.save_id
    assert store.run("r").reader(50).read_bytes("w.bin") == b"new weights"
    # the abandoned save went with its payload; nothing is left over
    assert store.orphans(0, runs=["r"]) == []


def test_a_valid_checkpoint_is_never_superseded(store):
    old = start(store, "r", None)
    save(store, "r", 40, old)
    new = start(store, "r", 40)
    with pytest.raises(CommitConflictError, match="save-40 is already committed"):
        store.run("r").begin(40, fence=new)
    save(store, "r", 41, new)
    with pytest.raises(CommitConflictError):  # nor by the attempt that committed it
        store.run("r").begin(41, fence=new)


def test_a_marker_of_a_newer_epoch_makes_begin_stale(store):
    old = start(store, "r", None)
    new = start(store, "r", None)
    save(store, "r", 5, new)
    with pytest.raises(FencedOutError, match="no longer current"):
        store.run("r").begin(5, fence=old)
    # also when the up-front check is skipped: the marker's own epoch says so
    with pytest.raises(FencedOutError, match="no longer current"):
        store.run("r").begin(5, fence=old, recheck=False)


def test_an_unfenced_writer_is_refused_on_a_fenced_run(store):
    start(store, "r", None)
    with pytest.raises(FencedOutError, match="is fenced: its current attempt is epoch 1"):
        store.run("r").begin(1)


def test_unfenced_checkpoints_are_history_until_the_first_fenced_attempt(store):
    with store.run("r").begin(7) as writer:
        writer.write_bytes("w.bin", b"legacy")
        writer.commit()
    assert store.run("r").latest().step == 7 and store.run("r").read_manifest(7).epoch == 0
    start(store, "r", 7)
    assert store.run("r").latest().step == 7


def test_a_condemned_save_is_never_latest_and_is_kept_until_removed(store):
    fence = start(store, "r", None)
    save(store, "r", 10, fence)
    bad = save(store, "r", 20, fence)
    store.run("r").condemn(20, bad, "crc32c mismatch in w.bin")
    assert store.run("r").latest().step == 10
    assert store.run("r").condemned() == [(20, bad.save_id)]
    assert store.orphans(0, runs=["r"]) == []  # kept for inspection, not garbage
    # saving the step again keeps the condemned payload and record beside the new save
    again = save(store, "r", 20, fence)
    assert store.run("r").latest().save_id == again.save_id
    assert store.run("r").condemned() == [(20, bad.save_id)]
    store.run("r").remove_condemned(20, bad.save_id)
    assert store.run("r").condemned() == []
    assert store.run("r").verify(20, deep=True).ok


def test_a_damaged_marker_is_superseded_but_kept_as_a_record(store):
    fence = start(store, "r", None)
    save(store, "r", 3, fence)
    store.location.fs.pipe_file(f"{store.run('r').checkpoint_path(3)}/_COMMIT", b"{not json")
    assert store.run("r").latest() is None
    save(store, "r", 3, fence)
    assert store.run("r").latest().step == 3
    assert len(store.run("r").condemned()) == 1


def test_reading_a_file_checks_its_crc32c(store):
    fence = start(store, "r", None)
    save(store, "r", 1, fence, {"a.bin": b"abcdefgh"})
    reader = store.run("r").reader(1)
    store.location.fs.pipe_file(f"{reader.path}/a.bin", b"abcdefgX")
    with pytest.raises(CorruptCheckpointError, match=r"a.bin of checkpoint .* manifest \(crc32c"):
        store.run("r").reader(1).read_bytes("a.bin")
    assert store.run("r").reader(1, verify=False).read_bytes("a.bin") == b"abcdefgX"


HOSTILE_NAMES = ["../../etc/passwd", "/etc/passwd", "a\\b", "a/../../b", "nul\x00byte", "", "."]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_manifest_naming_a_file_outside_its_checkpoint_is_corrupt(store, name):
    fence = start(store, "r", None)
    good = save(store, "r", 1, fence)
    body = json.loads(good.to_json())
    body["files"] = [{"name": name, "size": 3, "crc32c": crc32c_of(b"abc")}]
    body["total_bytes"], body["file_count"] = 3, 1
    store.location.fs.pipe_file(
        f"{store.run('r').checkpoint_path(1)}/_COMMIT", json.dumps(body).encode()
    )
    with pytest.raises(CorruptCheckpointError, match="not a valid manifest"):
        store.run("r").reader(1)
    with pytest.raises(CorruptCheckpointError):
        store.run("r").verify(1)
    assert store.run("r").latest() is None


@pytest.mark.parametrize(
    "change",
    [
        {"file_count": 5},
        {"total_bytes": 1},
        {"files": [{"name": "a", "size": -1, "crc32c": "AAAAAA=="}]},
        {"files": [{"name": "a", "size": 1 << 60, "crc32c": "AAAAAA=="}]},
        {"files": [{"name": "a", "size": 1, "crc32c": "not-crc"}]},
        {"files": [{"name": "a", "size": 1, "crc32c": "AAAAAA=="}] * 2},
        {"payload": "../elsewhere"},
        {"save_id": "../x", "payload": "../x"},
        {"epoch": -1},
        {"format_version": 99},
    ],
)
def test_a_manifest_with_impossible_fields_is_corrupt(change):
    good = Manifest(run="r", step=1, save_id="e1-abc", payload="e1-abc", epoch=1, files=())
    body = {**json.loads(good.to_json()), **change}
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(json.dumps(body).encode(), where="x/_COMMIT")


def test_a_format_1_manifest_reads_as_epoch_0_with_files_in_the_step_directory():
    body = {
        "format_version": 1,
        "run": "r",
        "step": 3,
        "attempt_id": "0123abcd",
        "files": [{"name": "a", "size": 1, "crc32c": crc32c_of(b"x")}],
        "total_bytes": 1,
        "file_count": 1,
    }
    manifest = Manifest.from_json(json.dumps(body).encode(), where="x")
    assert (manifest.epoch, manifest.save_id, manifest.payload) == (0, "0123abcd", "")
