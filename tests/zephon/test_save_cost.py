"""The catalog work of a small save (issue 22: the fixed cost of a small save): a save with a
catalog opens three transactions, arming its row, committing it and retention's one read (the
plan, which also carries the current attempt and the held claims), that retention still
refuses a stale attempt and takes over a dead gc's claims, and that a small state is written
into one shard file without starting a pool of writer threads.

Times belong to ``benchmarks/small_saves.py``; these tests count work, which does not depend
on the machine."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import event
from sqlalchemy.engine import Engine
from torch import nn

from zephon import CheckpointingConfig, CheckpointManager
from zephon.catalog import Catalog


@contextlib.contextmanager
def catalog_transactions() -> Iterator[list[str]]:
    """The transactions committed on any SQLAlchemy engine while the block runs."""
    seen: list[str] = []

    def on_commit(connection) -> None:
        seen.append(str(connection.engine.url))

    event.listen(Engine, "commit", on_commit)
    try:
        yield seen
    finally:
        event.remove(Engine, "commit", on_commit)


def state() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


@pytest.fixture
def config(tmp_path) -> CheckpointingConfig:
    return CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        period_steps=1,
        num_to_keep=None,
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
    )


def test_a_save_with_a_catalog_opens_three_transactions(config):
    """begin_checkpoint, mark_committed, then retention's plan: its read also gives the
    current attempt (the fence check, and the lineage mirror's) and the held claims."""
    job = state()
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        manager.load_latest(job)
        manager.save(1, job)  # the first save also registers the job's attempt
        with catalog_transactions() as seen:
            manager.save(2, job)
        assert len(seen) == 3, seen
        assert manager.catalog.get_checkpoint("r", 2).state == "committed"


@contextlib.contextmanager
def threads_started() -> Iterator[list[str]]:
    """The names of the threads started while the block runs."""
    started: list[str] = []
    original = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        started.append(thread.name)
        original(thread)

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        yield started
    finally:
        threading.Thread.start = original  # type: ignore[method-assign]


def distcp_files(manager: CheckpointManager, step: int) -> list[str]:
    """The DCP shard files of checkpoint ``step`` (in its save's payload directory)."""
    folder = Path(manager.store.run("r").checkpoint_url(step))
    return sorted(path.name for path in folder.glob("*/dcp/*.distcp"))


def test_a_small_save_writes_one_shard_file_without_a_thread_pool(config):
    """Below ``SMALL_PLAN_BYTES`` a rank's tensors go into one shard file written by the saving
    thread (no pool of writer threads to start per save), and load back as they were."""
    job = state()
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        manager.load_latest(job)
        with threads_started() as started:
            manager.save(1, job)
        assert distcp_files(manager, 1) == ["__0_0.distcp"]
        assert not [name for name in started if name.startswith("zephon-dcp-write")], started
    saved = job["model"].state_dict()
    torch.manual_seed(1)
    fresh = nn.Linear(4, 3)
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        resume = manager.load_latest(
            {"model": fresh, "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1)}
        )
    assert resume.next_step == 2
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_a_larger_save_still_writes_its_shards_in_parallel(config):
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # 2 MiB: above the bound
    job = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        manager.load_latest(job)
        manager.save(1, job)
        assert len(distcp_files(manager, 1)) == 4  # ZephonStorageWriter's thread_count


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_a_saves_retention_takes_over_the_claim_of_a_gc_that_died(config):
    job = state()
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        manager.load_latest(job)
        for step in (1, 2, 3):
            manager.save(step, job)
        user = manager.catalog.events(run="r")[0].actor.split("@")[0]
        actor = f"{user}@{socket.gethostname()}:{dead_pid()}"
        with Catalog(config.catalog_url, actor=actor) as dead_gc:
            claimed = dead_gc.claim_for_deletion("r", [1], requested=True)
        assert [row.step for row in claimed] == [1]
        assert manager.catalog.retention_plan("r").held == (1,)
        manager.save(4, job)  # its retention judges the holder gone and finishes the delete
        assert manager.catalog.get_checkpoint("r", 1).state == "deleted"
        assert manager.store.run("r").committed_steps() == [2, 3, 4]


@pytest.mark.parametrize("mib", [0, 2], ids=["small", "2MiB"])
def test_the_dropin_writer_writes_a_small_plan_into_one_file_and_a_larger_one_in_parallel(
    tmp_path, mib
):
    """The small-plan rule lives in ZephonStorageWriter, so torch's own ``dcp.save`` through
    the drop-in Writer gets it too: one file and no writer threads below 1 MiB, four files
    written in parallel above it."""
    import torch.distributed.checkpoint as dcp

    from zephon import dcp as zd

    run_url = f"{tmp_path}/ckpt/r"
    elements = max(mib << 18, 16)  # float32: 2 MiB, or 64 bytes
    state = {f"w{i}": torch.full((elements // 4,), float(i)) for i in range(4)}
    with zd.Writer(run_url, step=1) as writer, threads_started() as started:
        dcp.save(state, storage_writer=writer, checkpoint_id=f"{run_url}/save-1")
    shards = sorted(p.name for p in Path(run_url).glob("save-1/**/*.distcp"))
    writers = [name for name in started if name.startswith("zephon-dcp-write")]
    if mib:
        assert len(shards) == 4 and writers, (shards, started)
    else:
        assert shards == ["__0_0.distcp"] and not writers, (shards, started)
    loaded = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(loaded, storage_reader=zd.Reader(run_url))
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
