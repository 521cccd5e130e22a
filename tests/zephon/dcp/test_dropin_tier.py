"""``zephon.dcp.Writer(..., local_dir=)``: the drop-in DCP writer with the checkpoint manager's
local tier, in one process, against a real S3 (moto's server) and a SQLite catalog.

A save commits into ``local_dir`` and returns; the Writer's uploader copies it to the run's URL
through the one save path; ``zephon.dcp.Reader(local_dir=)`` loads the newest checkpoint from
the local copy; a stale Writer's pending upload is refused.
"""

from __future__ import annotations

import threading

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import database_url
from zephon import ConfigError, StaleAttemptError
from zephon import dcp as zd
from zephon.catalog import Catalog
from zephon.storage import CheckpointStore, CorruptCheckpointError

RUN = "dropin-tiered"


def state_at(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(64, 8), "b": torch.randn(8), "step": torch.tensor(step)}


def loaded(reader: zd.Reader) -> dict:
    target = {k: torch.zeros_like(v) for k, v in state_at(0).items()}
    dcp.load(target, storage_reader=reader)
    return target


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def files_of(store: CheckpointStore, step: int) -> dict[str, bytes]:
    reader = store.run(RUN).reader(step)
    return {name: reader.read_bytes(name) for name in reader.names}


class Gate:
    """Holds a Writer's uploads back until opened: the uploader (rank 0) asks for the attempt
    first thing in each upload, so wrapping that call delays every upload before it begins."""

    def __init__(self, writer: zd.Writer) -> None:
        self.open_ = threading.Event()
        uploader = writer.destination.uploader
        attempt = uploader._attempt

        def held():
            self.open_.wait(60)
            return attempt()

        uploader._attempt = held

    def open(self) -> None:
        self.open_.set()


@pytest.fixture
def catalog_url(request, tmp_path):
    with database_url("sqlite", request, tmp_path) as url:
        yield url


def test_a_save_commits_locally_first_then_uploads_the_same_bytes_with_timings(
    s3_backend, tmp_path, catalog_url
):
    url = f"{s3_backend.url}/{RUN}"
    local = CheckpointStore(str(tmp_path / "local"))
    remote = s3_backend.open_store()
    writer = zd.Writer(
        url,
        catalog=catalog_url,
        storage_options=s3_backend.storage_options,
        local_dir=str(tmp_path / "local"),
    )
    gate = Gate(writer)
    with writer:
        zd.save(state_at(1), writer, checkpoint_id=f"{url}/save-1")
        # returned with the local marker committed, the upload held back: nothing on S3 yet
        assert local.run(RUN).committed_steps() == [1]
        assert remote.run(RUN).committed_steps() == []
        gate.open()
        writer.wait_uploads()
        assert remote.run(RUN).committed_steps() == [1]
        dcp.save(state_at(2), storage_writer=writer, checkpoint_id=f"{url}/save-2")  # plain DCP
    # close waited for step 2's upload; local_num_to_keep=1 dropped the uploaded step 1
    assert remote.run(RUN).committed_steps() == [1, 2]
    assert local.run(RUN).committed_steps() == [2]
    mine, theirs = local.run(RUN).read_manifest(2), remote.run(RUN).read_manifest(2)
    assert files_of(local, 2) == files_of(remote, 2)
    assert theirs.save_id != mine.save_id and theirs.epoch == mine.epoch
    assert remote.run(RUN).verify(2, deep=True).ok
    with Catalog(catalog_url) as catalog:
        for step in (1, 2):
            row = catalog.get_checkpoint(RUN, step)
            assert row.state == "committed", row
            assert row.save_id == remote.run(RUN).read_manifest(step).save_id
            assert {"local_s", "upload_s", "total_s"} <= set(row.timings or {}), row.timings
        replicas = {(r.step, r.tier): r.state for r in catalog.replicas(RUN)}
    assert replicas[(1, "local")] == "deleted" and replicas[(2, "local")] == "committed"
    assert replicas[(1, "save_dir")] == replicas[(2, "save_dir")] == "committed"


def test_the_reader_loads_the_newest_from_the_local_copy_without_s3_payload(
    s3_backend, tmp_path, catalog_url
):
    url = f"{s3_backend.url}/{RUN}"
    local_dir = str(tmp_path / "local")
    options = s3_backend.storage_options
    with zd.Writer(url, catalog=catalog_url, storage_options=options, local_dir=local_dir) as w:
        for step in (1, 2):
            zd.save(state_at(step), w, checkpoint_id=f"{url}/save-{step}")
    remote = s3_backend.open_store()
    manifest = remote.run(RUN).read_manifest(2)
    # S3 keeps step 2's marker (the run's latest) but no byte of its payload
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    payload = f"{s3_backend.url.split('://', 1)[1]}/{RUN}/save-2/{manifest.payload}"
    fs.rm(payload, recursive=True)
    reader = zd.Reader(url, catalog=catalog_url, storage_options=options)
    with reader, pytest.raises(CorruptCheckpointError):  # the URL alone can no longer load it
        zd.load({k: torch.zeros_like(v) for k, v in state_at(0).items()}, reader)
    for given in (catalog_url, None):
        reader = zd.Reader(url, catalog=given, storage_options=options, local_dir=local_dir)
        with reader:
            got = loaded(reader)
        assert reader.step == 2 and reader.from_local
        assert same(got, state_at(2))
    # a named step is read from the URL (step 1 is not in the local tier any more)
    with zd.Reader(url, storage_options=options, local_dir=local_dir) as reader:
        target = {k: torch.zeros_like(v) for k, v in state_at(0).items()}
        dcp.load(target, storage_reader=reader, checkpoint_id=f"{url}/save-1")
        assert reader.step == 1 and not reader.from_local
        assert same(target, state_at(1))


def test_the_reader_takes_the_url_when_the_local_copy_is_older_or_incomplete(s3_backend, tmp_path):
    url = f"{s3_backend.url}/{RUN}"
    options = s3_backend.storage_options
    old_dir, new_dir = str(tmp_path / "node-a"), str(tmp_path / "node-b")
    with zd.Writer(url, storage_options=options, local_dir=old_dir) as w:
        zd.save(state_at(1), w, checkpoint_id=f"{url}/save-1")
    with zd.Writer(url, storage_options=options, local_dir=new_dir) as w:
        zd.save(state_at(2), w, checkpoint_id=f"{url}/save-2")
    with zd.Reader(url, storage_options=options, local_dir=old_dir) as reader:
        got = loaded(reader)
    assert reader.step == 2 and not reader.from_local and same(got, state_at(2))
    # node-b's copy of step 2 with one file missing: not held in full, the URL is read
    local = CheckpointStore(new_dir)
    manifest = local.run(RUN).read_manifest(2)
    victim = manifest.files[0].name
    (tmp_path / "node-b" / RUN / "save-2" / manifest.payload / victim).unlink()
    with zd.Reader(url, storage_options=options, local_dir=new_dir) as reader:
        got = loaded(reader)
    assert reader.step == 2 and not reader.from_local and same(got, state_at(2))


def test_a_stale_writers_pending_upload_is_refused_and_the_new_writers_are_intact(
    s3_backend, tmp_path, catalog_url
):
    url = f"{s3_backend.url}/{RUN}"
    options = s3_backend.storage_options
    remote = s3_backend.open_store()
    old = zd.Writer(url, catalog=catalog_url, storage_options=options, local_dir=tmp_path / "a")
    zd.save(state_at(1), old, checkpoint_id=f"{url}/save-1")
    old.wait_uploads()
    gate = Gate(old)
    zd.save(state_at(2), old, checkpoint_id=f"{url}/save-2")  # committed locally, upload held
    new = zd.Writer(url, catalog=catalog_url, storage_options=options, local_dir=tmp_path / "b")
    with new:
        zd.save(state_at(20), new, checkpoint_id=f"{url}/save-2")  # registers: fences `old`
        zd.save(state_at(3), new, checkpoint_id=f"{url}/save-3")
        new.wait_uploads()
        gate.open()
        with pytest.raises(StaleAttemptError):
            old.wait_uploads()
        with pytest.raises(StaleAttemptError):  # its next save stops before writing
            zd.save(state_at(4), old, checkpoint_id=f"{url}/save-4")
        old.close()
    assert remote.run(RUN).committed_steps() == [1, 2, 3]
    epochs = {step: remote.run(RUN).read_manifest(step).epoch for step in (1, 2, 3)}
    assert epochs[2] == epochs[3] == new.attempt.epoch > old.attempt.epoch == epochs[1]
    assert remote.run(RUN).verify(2, deep=True).ok and remote.run(RUN).verify(3, deep=True).ok
    assert not remote.run(RUN).is_committed(4)
    with zd.Reader(url, catalog=catalog_url, storage_options=options) as reader:
        target = {k: torch.zeros_like(v) for k, v in state_at(0).items()}
        dcp.load(target, storage_reader=reader, checkpoint_id=f"{url}/save-2")
    assert same(target, state_at(20))
    with Catalog(catalog_url) as catalog:
        assert catalog.get_checkpoint(RUN, 2).save_id == remote.run(RUN).read_manifest(2).save_id
        refused = [
            r
            for r in catalog.replicas(RUN, step=2, tier="save_dir")
            if r.state == "failed" and "Stale" in (r.failure_reason or "")
        ]
    assert refused, "the stale upload left no failed save_dir replica row"


def test_a_local_checkpoint_whose_on_commit_raised_is_still_uploaded(s3_backend, tmp_path):
    url = f"{s3_backend.url}/{RUN}"

    def refuse(manifest):
        raise RuntimeError("on_commit says no")

    remote = s3_backend.open_store()
    options = s3_backend.storage_options
    with zd.Writer(url, storage_options=options, local_dir=tmp_path, on_commit=refuse) as w:
        with pytest.raises(zd.DistributedCheckpointError, match="on_commit says no"):
            zd.save(state_at(1), w, checkpoint_id=f"{url}/save-1")
        w.wait_uploads()
    assert remote.run(RUN).committed_steps() == [1]  # the local marker was committed: a checkpoint
    assert files_of(remote, 1) == files_of(CheckpointStore(str(tmp_path)), 1)


def test_bad_tier_arguments_get_the_managers_one_line_errors(tmp_path):
    url, local = f"{tmp_path}/r", tmp_path / "local"
    cases = [
        (lambda: zd.Writer(url, local_dir="s3://b/local"), "Writer.local_dir"),
        (lambda: zd.Writer(url, local_dir=local, local_num_to_keep=0), "local_num_to_keep"),
        (lambda: zd.Writer(url, local_dir=local, max_pending_uploads=0), "max_pending"),
        (lambda: zd.Reader(url, local_dir="gs://b/x"), "Reader.local_dir"),
    ]
    for make, words in cases:
        with pytest.raises(ConfigError) as info:
            make()
        message = str(info.value)
        assert words in message and "\n" not in message, message


# -- two gloo ranks ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False], ids=["shared-local-dir", "local-dir-per-rank"])
def test_two_ranks_upload_in_step_past_a_failed_save_and_load_the_latest(
    s3_backend, tmp_path, catalog_url, shared
):
    from tests.ranks import launch, store_config
    from tests.zephon.dcp.dropin_tier_worker import RUN as WORKER_RUN

    config = {
        **store_config(s3_backend),
        "catalog": catalog_url,
        "local": str(tmp_path / "local"),
        "shared": shared,
    }
    ranks = launch("tests.zephon.dcp.dropin_tier_worker", 2, config, timeout=120)
    for record in ranks:
        failure = record["write_failure"]
        assert failure["type"] == "BackendUnavailableError", failure
        assert "simulated" in failure["message"]
        assert record["upload_error"] is None, record["upload_error"]
        assert record["latest_step"] == 4 and record["latest_equal"], record
        # a shared local_dir holds the whole checkpoint; one per rank holds only its files
        assert record["from_local"] is shared, record
    assert ranks[0]["committed"] == [1, 2, 4] and ranks[1]["committed"] == []
    remote = s3_backend.open_store()
    assert remote.run(WORKER_RUN).committed_steps() == [1, 2, 4]
    assert remote.run(WORKER_RUN).verify(4, deep=True).ok
    names = {f.name for f in remote.run(WORKER_RUN).read_manifest(4).files}
    assert {"__0_0.distcp", "__1_0.distcp"} <= names
    local = CheckpointStore(str(tmp_path / "local" / ("" if shared else "rank0")))
    assert local.run(WORKER_RUN).committed_steps() == [4]  # local_num_to_keep=1
    with Catalog(catalog_url) as catalog:
        states = {row.step: row.state for row in catalog.list_checkpoints(WORKER_RUN)}
        timings = catalog.get_checkpoint(WORKER_RUN, 4).timings or {}
    assert states == {1: "committed", 2: "committed", 4: "committed"}, states
    assert {"local_s", "upload_s", "total_s"} <= set(timings), timings
