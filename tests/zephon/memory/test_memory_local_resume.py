"""Resuming from ``local_dir`` behind the memory tier on two simulated nodes, real ``torchrun``
processes (docs/memory.md, "A local disk behind memory"): every node rebooted (its memory
gone, its local disk kept) resumes from local_dir, every loss equal to the uninterrupted
run's (``cluster.crash_then_resume``); with every node alive, memory still comes first; a
stale attempt's local copy is never loaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.zephon.memory.cluster import (
    CRASH,
    STEPS,
    check_losses,
    crash_then_resume,
    launch,
    spec,
    start_of,
)
from tests.zephon.memory.memory_job import reference_losses
from zephon.storage import CheckpointStore

pytestmark = pytest.mark.slow


def _nodes(tmp_path, count=2):
    return [tmp_path / f"m{i}" for i in range(count)], [tmp_path / f"nvme{i}" for i in range(count)]


def test_every_node_rebooted_resumes_from_its_local_dir_not_save_dir(tmp_path):
    memory, local = _nodes(tmp_path)
    start, log = crash_then_resume(tmp_path, memory, lose=[0, 1], local_dirs=local)
    # save_dir's copy lost its tensors (strip): only local_dir could have given these losses
    assert start["step"] == CRASH and start["url"].startswith(str(local[0])), log
    assert "in every rank's local_dir" in log, log
    for node in local:  # each node's copy of the last save, whole; local_num_to_keep: 1
        run = CheckpointStore(str(node)).run("mem")
        assert run.committed_steps() == [STEPS] and run.verify(STEPS, deep=True).ok


def test_with_memory_alive_memory_comes_before_local_dir(tmp_path):
    memory, local = _nodes(tmp_path)
    start, log = crash_then_resume(tmp_path, memory, local_dirs=local)
    assert start["step"] == CRASH and "/.resume/" in start["url"], log


def test_two_nodes_of_two_ranks_resume_from_local_dir_and_upload_what_save_dir_missed(tmp_path):
    memory, local = _nodes(tmp_path)
    start, log = crash_then_resume(
        tmp_path, memory, lose=[0, 1], nproc=2, unupload=True, local_dirs=local
    )
    assert start["step"] == CRASH and start["url"].startswith(str(local[0])), log
    # newer than save_dir's latest: the new attempt uploaded it, from rank 0's local copy
    run = CheckpointStore(str(tmp_path / "save_dir")).run("mem")
    assert CRASH in run.committed_steps() and run.verify(CRASH, deep=True).ok


def test_a_stale_attempts_local_copy_is_never_loaded(tmp_path):
    """Attempt 1 saves step 4 in memory and on local disk and dies. Attempt 2, on other nodes,
    resumes from step 2 (save_dir's step 4 is gone) and dies before saving: attempt 1's step 4
    is no longer in the run's history. Attempt 3, back on the first nodes after a reboot (their
    memory gone, their disks kept), finds step 4 whole on every local disk and must not load
    it."""
    memory, local = _nodes(tmp_path)
    first = spec(tmp_path, "first", crash_after=CRASH)
    launch(first, memory, 1, expect=17, local_dirs=local)
    shutil.rmtree(tmp_path / "save_dir" / "mem" / f"save-{CRASH}")
    second = spec(tmp_path, "second", die_at=CRASH - 1)
    others = [tmp_path / "other-m0", tmp_path / "other-m1"]
    launch(second, others, 1, expect=18, local_dirs=[tmp_path / "o0", tmp_path / "o1"])
    assert start_of(second)["step"] == CRASH - 2
    for node in memory:
        shutil.rmtree(node)
    assert all(CRASH in CheckpointStore(str(n)).run("mem").committed_steps() for n in local)
    third = spec(tmp_path, "third")
    log = launch(third, memory, 1, expect=0, local_dirs=local)
    start = start_of(third)
    assert start["step"] == CRASH - 2 and start["url"].startswith(str(tmp_path / "save_dir")), log
    check_losses(Path(third["out"]), reference_losses(2, STEPS))
