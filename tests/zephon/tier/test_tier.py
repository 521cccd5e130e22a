"""The local tier in one process: a local_dir beside a real S3 save_dir (moto's server) and a
SQLite or PostgreSQL catalog. Saves commit locally, uploads commit the same bytes under
save_dir, local retention keeps what is not uploaded, resume prefers a complete local copy.
The multi-process runs are in test_tier_distributed.py."""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import s3fs
import torch
from torch import nn

from tests.conftest import Backend
from tests.faults import FaultProxy
from tests.zephon.saves import largest_tensor_slice
from zephon import StaleAttemptError
from zephon.attempts import register
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig, load_job_config
from zephon.destinations.local.uploader import UploadsFailedError, copy_verified
from zephon.errors import ConfigError
from zephon.locations import RunLocation
from zephon.storage import (
    NO_RETRY,
    BackendUnavailableError,
    CheckpointStore,
    CorruptCheckpointError,
)

RUN = "tiered"


def model_at(step: int) -> nn.Module:
    torch.manual_seed(step)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))


def state_at(step: int) -> dict:
    return {"model": model_at(step), "notes": {"step": step}}


def config(backend: Backend, local: Path, catalog_url: str | None, **extra) -> CheckpointingConfig:
    return CheckpointingConfig(
        save_dir=backend.url,
        storage_options=backend.storage_options,
        local_dir=str(local),
        catalog_url=catalog_url,
        **extra,
    )


def files_of(store: CheckpointStore, step: int) -> dict[str, bytes]:
    reader = store.run(RUN).reader(step)
    return {name: reader.read_bytes(name) for name in reader.names}


def loads(manager: CheckpointManager, step: int):
    """load_latest into a model of other values; the resume and whether it holds step's."""
    target = {"model": model_at(1000), "notes": None}
    resume = manager.load_latest(target)
    expected = model_at(step).state_dict()
    equal = all(torch.equal(v, expected[k]) for k, v in target["model"].state_dict().items())
    return resume, equal


class BucketAway:
    """The save_dir's bucket taken away (every object kept aside) and brought back: uploads
    in between fail as they would against a bucket that refuses them."""

    def __init__(self, backend: Backend) -> None:
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **backend.storage_options)
        self.bucket = backend.bucket
        self.kept: dict[str, bytes] = {}

    def __enter__(self) -> BucketAway:
        self.kept = {path: self.fs.cat_file(path) for path in self.fs.find(self.bucket)}
        self.fs.rm(list(self.kept))
        self.fs.rmdir(self.bucket)
        return self

    def __exit__(self, *exc: object) -> None:
        self.fs.mkdir(self.bucket)
        for path, data in self.kept.items():
            self.fs.pipe_file(path, data)


def test_a_url_local_dir_is_refused_in_one_line():
    with pytest.raises(ConfigError) as caught:
        CheckpointingConfig(save_dir="s3://b/ckpt", local_dir="s3://b/local")
    assert "trainer.checkpointing.local_dir" in str(caught.value)
    assert "\n" not in str(caught.value)
    for key in ("local_num_to_keep", "max_pending_uploads"):
        with pytest.raises(ConfigError, match=f"trainer.checkpointing.{key} = 0"):
            CheckpointingConfig(save_dir="x", local_dir="/tmp/x", **{key: 0})
    job = load_job_config(
        {
            "run": {"name": RUN},
            "trainer": {
                "checkpointing": {
                    "save_dir": "s3://b/ckpt",
                    "local_dir": "file:///local_nvme/ckpt",
                    "local_num_to_keep": 2,
                    "max_pending_uploads": 3,
                }
            },
        }
    )
    loaded = job.checkpointing
    assert (loaded.local_dir, loaded.local_num_to_keep, loaded.max_pending_uploads) == (
        "/local_nvme/ckpt",
        2,
        3,
    )
    defaults = CheckpointingConfig(save_dir="x", local_dir="/tmp/x")
    assert (defaults.local_num_to_keep, defaults.max_pending_uploads) == (1, 2)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_upload_commits_the_local_files_with_replica_rows_and_timings(
    s3_backend, tmp_path, catalog_url, async_save
):
    local = CheckpointStore(str(tmp_path / "local"))
    remote = s3_backend.open_store()
    cfg = config(s3_backend, tmp_path / "local", catalog_url, async_save=async_save)
    with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
        manager.save(1, state_at(1))
        manager.wait()
        assert local.run(RUN).committed_steps() == [1]
        assert remote.run(RUN).committed_steps() == [1]
        mine, theirs = local.run(RUN).read_manifest(1), remote.run(RUN).read_manifest(1)
        assert {(f.name, f.size, f.crc32c) for f in mine.files} == {
            (f.name, f.size, f.crc32c) for f in theirs.files
        }
        assert files_of(local, 1) == files_of(remote, 1)
        assert theirs.save_id != mine.save_id and theirs.epoch == mine.epoch == 1
        manager.save(2, state_at(2))
        manager.wait()
    assert local.run(RUN).committed_steps() == [2]  # local_num_to_keep 1: step 1 was uploaded
    assert remote.run(RUN).committed_steps() == [1, 2]
    with Catalog(catalog_url) as catalog:
        row = catalog.get_checkpoint(RUN, 2)
        assert row.state == "committed" and row.save_id == remote.run(RUN).read_manifest(2).save_id
        phases = {"stall_s", "local_s", "upload_s", "total_s"} | (
            {"stage_s"} if async_save else set()
        )
        assert phases <= set(row.timings or {}), row.timings
        replicas = {(r.step, r.tier): r for r in catalog.replicas(RUN)}
    assert replicas[(1, "local")].state == "deleted"
    assert replicas[(2, "local")].state == "committed"
    assert replicas[(2, "local")].save_id == local.run(RUN).read_manifest(2).save_id
    for step in (1, 2):
        uploaded = replicas[(step, "save_dir")]
        assert (uploaded.state, uploaded.host) == ("committed", "")
        assert uploaded.bytes == remote.run(RUN).read_manifest(step).total_bytes
        assert {"upload_s", "total_s"} <= set(uploaded.timings or {})


def through(backend: Backend, proxy: FaultProxy) -> Backend:
    """The same save_dir through ``proxy`` (the job gives each failed request up at once:
    ``retry=NO_RETRY``, so what reaches the uploader is a failure that outlived storage's own
    retries)."""
    options = {
        **backend.storage_options,
        "client_kwargs": {"endpoint_url": proxy.url},
        "config_kwargs": {"connect_timeout": 2},
    }
    return replace(backend, storage_options=options)


def commits_seen(proxy: FaultProxy) -> list[int]:
    """The steps whose save_dir marker the proxy saw committed, in the order it did."""
    return [
        int(m.group(1))
        for seen in proxy.log
        if seen.method == "PUT" and seen.outcome == "ok"
        for m in [re.search(r"/save-(\d+)/_COMMIT", seen.path)]
        if m
    ]


def test_uploads_failed_in_an_outage_are_retried_in_step_order_once_the_store_is_back(
    s3, s3_backend, tmp_path, catalog_url, caplog
):
    local = CheckpointStore(str(tmp_path / "local"))
    remote = s3_backend.open_store()
    with FaultProxy(s3.endpoint_url, seed=7) as proxy:
        cfg = config(
            through(s3_backend, proxy),
            tmp_path / "local",
            catalog_url,
            num_to_keep=2,
            max_pending_uploads=3,
            retry=NO_RETRY,
        )
        manager = CheckpointManager(cfg, run_name=RUN, total_steps=10)
        manager.tier.uploader.retry_base_s = manager.tier.uploader.retry_max_s = 0.3
        manager.save(1, state_at(1))
        manager.wait()
        proxy.outage(True)
        with caplog.at_level(logging.WARNING, logger="zephon"):
            for step in (2, 3, 4):
                manager.save(step, state_at(step))  # a 4th pending one would wait
            with pytest.raises(UploadsFailedError) as caught:
                manager.wait()
            # 2 is superseded (3 and 4 are newer, num_to_keep 2), 3 fails and is retried, 4
            # waits behind it: every one reported, one line each
            assert caught.value.steps == [2, 3, 4]
            lines = str(caught.value).splitlines()
            assert len(lines) == 4 and "superseded by steps [3, 4]" in lines[1]
            assert local.run(RUN).committed_steps() == [3, 4]  # 2 dropped; 3, 4 kept until uploaded
            with pytest.raises(UploadsFailedError) as again:
                manager.finish()  # still down: finish reports what is still failing
            assert 4 in again.value.steps
        assert any("superseded" in r.getMessage() for r in caplog.records)
        proxy.outage(False)
        manager.wait()  # the retries go through, in step order
        manager.finish()
        manager.close()
        assert commits_seen(proxy) == [1, 3, 4]
    assert remote.run(RUN).committed_steps() == [3, 4]  # num_to_keep 2 dropped 1 after 3 and 4
    assert local.run(RUN).committed_steps() == [4]
    with Catalog(catalog_url) as catalog:
        states = {(r.step, r.tier): r.state for r in catalog.replicas(RUN)}
        events = [e for e in catalog.events(run=RUN) if e.action == "upload_superseded"]
        assert catalog.get_checkpoint(RUN, 4).state == "committed"
    assert [(e.step, e.detail["superseded_by"]) for e in events] == [(2, [3, 4])]
    assert states[(2, "local")] == "deleted" and states[(2, "save_dir")] == "failed"
    assert states[(3, "save_dir")] == states[(4, "save_dir")] == "committed"
    shutil.rmtree(tmp_path / "local")
    with CheckpointManager(
        config(s3_backend, tmp_path / "local", catalog_url), run_name=RUN, total_steps=10
    ) as fresh:
        resume, equal = loads(fresh, 4)
    assert (resume.step, equal, resume.url) == (4, True, remote.run(RUN).checkpoint_url(4))


def test_resume_from_the_local_tier_reads_no_payload_of_save_dir(s3_backend, tmp_path):
    cfg = config(s3_backend, tmp_path / "local", None)
    with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
        manager.save(3, state_at(3))
    remote = s3_backend.open_store()
    manifest = remote.run(RUN).read_manifest(3)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_backend.storage_options)
    payload = f"{remote.run(RUN).checkpoint_path(3)}/{manifest.payload}"
    fs.rm(payload, recursive=True)  # a load from save_dir could not succeed now
    with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
        resume, equal = loads(manager, 3)
    assert (resume.step, equal, resume.values["notes"]) == (3, True, {"step": 3})
    assert resume.url == CheckpointStore(str(tmp_path / "local")).run(RUN).checkpoint_url(3)


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_resume_from_save_dir_when_the_local_copy_is_missing_or_damaged(
    s3_backend, tmp_path, catalog_url, damage, caplog
):
    cfg = config(s3_backend, tmp_path / "local", catalog_url)
    with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
        manager.save(2, state_at(2))
    local = CheckpointStore(str(tmp_path / "local"))
    if damage == "missing":
        shutil.rmtree(tmp_path / "local")
    else:
        # a byte in the middle of the largest tensor's elements (a small state is one shard
        # file, whose middle byte may fall between tensors)
        reader = local.run(RUN).reader(2)
        where = largest_tensor_slice(reader.read_bytes("dcp/dcp_metadata.json"), reader.url)
        path = Path(reader.path) / where.file
        data = bytearray(path.read_bytes())
        data[where.offset + where.length // 2] ^= 0x01
        path.write_bytes(bytes(data))
    with (
        caplog.at_level(logging.WARNING, logger="zephon"),
        CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager,
    ):
        resume, equal = loads(manager, 2)
    assert (resume.step, equal) == (2, True)
    assert resume.url == s3_backend.open_store().run(RUN).checkpoint_url(2)
    with Catalog(catalog_url) as catalog:
        assert catalog.get_checkpoint(RUN, 2).state == "committed"  # never quarantined
    if damage == "flipped":
        assert [step for step, _ in local.run(RUN).condemned()] == [2]
        assert any("local checkpoint" in r.getMessage() for r in caplog.records)


def test_a_newer_local_step_is_resumed_and_uploaded_by_the_next_attempt(
    s3_backend, tmp_path, catalog_url
):
    cfg = config(s3_backend, tmp_path / "local", catalog_url, local_num_to_keep=2)
    manager = CheckpointManager(cfg, run_name=RUN, total_steps=10)
    manager.save(1, state_at(1))
    manager.wait()
    with BucketAway(s3_backend):
        manager.save(2, state_at(2))  # never uploaded: the attempt "dies" with it local only
        with pytest.raises(Exception):  # noqa: B017 - whatever the missing bucket raises
            manager.close()
    remote = s3_backend.open_store()
    assert remote.run(RUN).committed_steps() == [1]
    with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
        resume, equal = loads(manager, 2)  # L = 2 > R = 1
        assert (resume.step, equal) == (2, True)
        manager.wait()
        assert manager.attempt.resumed_from == 2
        epoch = manager.attempt.epoch
    assert remote.run(RUN).committed_steps() == [1, 2]
    assert remote.run(RUN).read_manifest(2).epoch == epoch == 2
    assert files_of(remote, 2) == files_of(CheckpointStore(str(tmp_path / "local")), 2)
    with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
        shutil.rmtree(tmp_path / "local")
        resume, equal = loads(manager, 2)  # now from save_dir
        assert (resume.step, equal) == (2, True)


def superseded(
    cfg: CheckpointingConfig, backend: Backend, catalog_url: str
) -> tuple[CheckpointManager, CheckpointStore]:
    """An attempt (``old``) that saved and uploaded step 1, then a new start of the run
    registered while it still runs: every later save of ``old`` is stale. ``old`` and the
    save_dir's store."""
    old = CheckpointManager(cfg, run_name=RUN, total_steps=10)
    old.save(1, state_at(1))
    old.wait()
    remote = backend.open_store()
    with Catalog(catalog_url) as catalog:
        location = RunLocation(RUN, remote, RUN)
        register(location, catalog, lineage=remote.run(RUN).lineage(), resumed_from=1)
    return old, remote


def test_a_stale_attempts_uploads_are_refused(s3_backend, tmp_path, catalog_url):
    cfg = config(s3_backend, tmp_path / "local", catalog_url)
    old, remote = superseded(cfg, s3_backend, catalog_url)
    old.save(2, state_at(2))  # commits locally; its upload is refused
    with pytest.raises(StaleAttemptError):
        old.wait()
    with pytest.raises(StaleAttemptError):
        old.save(3, state_at(3))  # the job must stop
    old.close()
    assert remote.run(RUN).committed_steps() == [1]
    with Catalog(catalog_url) as catalog:
        assert catalog.get_checkpoint(RUN, 1).state == "committed"
        uploads = catalog.replicas(RUN, step=2, tier="save_dir")
        assert [r.state for r in uploads] == ["failed"]
        assert "StaleAttemptError" in (uploads[0].failure_reason or "")


def test_a_local_file_that_changed_on_disk_is_never_uploaded(s3_backend, tmp_path):
    local = CheckpointStore(str(tmp_path / "local"))
    with local.run(RUN).begin(1) as writer:
        entry = writer.write_bytes("blob.bin", b"x" * 100_000)
        writer.commit()
    manifest = local.run(RUN).read_manifest(1)
    path = Path(local.run(RUN).checkpoint_path(1)) / manifest.payload / "blob.bin"
    path.write_bytes(b"x" * 50_000 + b"y" + b"x" * 49_999)
    remote = s3_backend.open_store()
    target = remote.run(RUN).begin(1)
    with pytest.raises(CorruptCheckpointError, match="blob.bin"):
        copy_verified([entry], str(path.parent), target)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_backend.storage_options)
    assert not fs.exists(f"{target.payload_path}/blob.bin")
    path.write_bytes(b"x" * 100_000)
    copy_verified([entry], str(path.parent), target)  # the intact file goes out as it is
    target.add_entries([entry])
    target.commit()
    assert remote.run(RUN).reader(1).read_bytes("blob.bin") == b"x" * 100_000


def test_without_a_catalog_everything_works_untracked(s3_backend, tmp_path):
    cfg = config(s3_backend, tmp_path / "local", None, num_to_keep=1)
    with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
        for step in (1, 2, 3):
            manager.save(step, state_at(step))
        manager.finish()
    assert s3_backend.open_store().run(RUN).committed_steps() == [3]
    assert CheckpointStore(str(tmp_path / "local")).run(RUN).committed_steps() == [3]
    with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
        resume, equal = loads(manager, 3)
    assert (resume.step, equal) == (3, True)


def test_a_finished_run_uploads_its_last_step_if_only_the_local_tier_has_it(s3_backend, tmp_path):
    cfg = config(s3_backend, tmp_path / "local", None)
    manager = CheckpointManager(cfg, run_name=RUN, total_steps=2)
    manager.save(1, state_at(1))
    manager.wait()
    with BucketAway(s3_backend):
        manager.save(2, state_at(2))
        with pytest.raises(Exception):  # noqa: B017 - whatever the missing bucket raises
            manager.close()
    remote = s3_backend.open_store()
    assert remote.run(RUN).committed_steps() == [1]
    with CheckpointManager(cfg, run_name=RUN, total_steps=2) as manager:
        resume = manager.load_latest({"model": model_at(1000), "notes": None})
        assert (resume.step, resume.finished) == (2, True)
        manager.finish()
    assert remote.run(RUN).committed_steps() == [1, 2]
    assert files_of(remote, 2) == files_of(CheckpointStore(str(tmp_path / "local")), 2)


def test_a_stale_attempt_never_touches_the_current_ones_local_checkpoints(
    s3_backend, tmp_path, catalog_url
):
    cfg = config(s3_backend, tmp_path / "local", catalog_url)  # one local_dir for both
    local = CheckpointStore(str(tmp_path / "local"))
    old = CheckpointManager(cfg, run_name=RUN, total_steps=20)
    old.save(2, state_at(2))
    old.wait()
    new = CheckpointManager(cfg, run_name=RUN, total_steps=20)
    resume, equal = loads(new, 2)
    assert (resume.step, equal, resume.url) == (2, True, local.run(RUN).checkpoint_url(2))
    new.save(3, state_at(3))
    new.wait()
    assert local.run(RUN).committed_steps() == [3]
    old.save(10, state_at(10))  # the old attempt, still running: local commit, upload refused
    with pytest.raises(StaleAttemptError):
        old.wait()
    assert local.run(RUN).committed_steps() == [3, 10]  # the new attempt's 3 is untouched
    new.save(4, state_at(4))
    new.wait()
    # 10 is of an abandoned history: it goes, and never counts as the newest local checkpoint
    assert local.run(RUN).committed_steps() == [4]
    assert s3_backend.open_store().run(RUN).committed_steps() == [2, 3, 4]
    old.close()
    new.close()


def test_files_upload_several_at_once_and_one_damaged_file_fails_the_copy(s3_backend, tmp_path):
    local = CheckpointStore(str(tmp_path / "local"))
    blobs = {f"shard-{i}.bin": bytes([i]) * (50_000 + i) for i in range(12)}
    with local.run(RUN).begin(1) as writer:
        entries = [writer.write_bytes(name, data) for name, data in blobs.items()]
        writer.commit()
    payload = Path(local.run(RUN).checkpoint_path(1)) / local.run(RUN).read_manifest(1).payload
    remote = s3_backend.open_store()
    target = remote.run(RUN).begin(1)
    copy_verified(entries, str(payload), target, threads=4)
    target.add_entries(entries)
    target.commit()
    reader = remote.run(RUN).reader(1)
    assert {name: reader.read_bytes(name) for name in blobs} == blobs

    (payload / "shard-5.bin").write_bytes(b"\xff" * len(blobs["shard-5.bin"]))
    again = remote.run(RUN).begin(2)
    with pytest.raises(CorruptCheckpointError, match="shard-5.bin"):
        copy_verified(entries, str(payload), again, threads=4)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_backend.storage_options)
    assert not fs.exists(f"{again.payload_path}/shard-5.bin")


def test_a_full_local_dir_names_local_dir_and_the_fix(tmp_path, mounts):
    disk = mounts.small_disk(tmp_path / "nvme", "64k")
    cfg = CheckpointingConfig(save_dir=str(tmp_path / "save"), local_dir=str(disk / "local"))
    manager = CheckpointManager(cfg, run_name=RUN, total_steps=10)
    with pytest.raises(BackendUnavailableError) as caught:
        manager.save(1, {"model": nn.Linear(200, 200)})  # 160 kB of weights
    manager.close()
    message = str(caught.value)
    assert "\n" not in message and "save_dir" not in message
    assert f"the disk holding local_dir {disk}/local is full" in message
    assert "set local_dir to a directory on a larger disk" in message


@pytest.mark.slow  # an outage and a retry
def test_a_local_file_damaged_before_a_one_rank_upload_is_never_published(s3, s3_backend, tmp_path):
    """One rank sends its files with the commit (``commit(files=...)``): a file whose bytes
    no longer match the local manifest fails its own upload before the object completes, the
    commit sends no marker, and the local step is condemned, not retried."""
    local = CheckpointStore(str(tmp_path / "local"))
    remote = s3_backend.open_store()
    with FaultProxy(s3.endpoint_url, seed=3) as proxy:
        cfg = config(through(s3_backend, proxy), tmp_path / "local", None, retry=NO_RETRY)
        manager = CheckpointManager(cfg, run_name=RUN, total_steps=10)
        manager.tier.uploader.retry_base_s = manager.tier.uploader.retry_max_s = 0.3
        manager.save(1, state_at(1))
        manager.wait()
        proxy.outage(True)
        manager.save(2, state_at(2))  # its upload fails and waits for a retry
        with pytest.raises(UploadsFailedError):
            manager.wait()
        manifest = local.run(RUN).read_manifest(2)
        shard = max((f for f in manifest.files if f.name.endswith(".distcp")), key=lambda f: f.size)
        path = Path(local.run(RUN).checkpoint_path(2)) / manifest.payload / shard.name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        proxy.outage(False)
        with pytest.raises(UploadsFailedError) as caught:
            manager.wait()
        assert caught.value.steps == [2] and "damaged and is not uploaded" in str(caught.value), (
            caught.value
        )
        manager.close()
    assert remote.run(RUN).committed_steps() == [1]
    assert [step for step, _ in local.run(RUN).condemned()] == [2]
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_backend.storage_options)
    step_two = [key for key in fs.find(s3_backend.bucket) if "/save-2/" in key]
    assert not any(key.endswith(f"/{shard.name}") for key in step_two), step_two
