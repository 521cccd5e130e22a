"""Resuming from ``local_dir`` behind the memory tier on two simulated nodes, real ``torchrun``
processes (docs/memory.md, "A local disk behind memory"): every node rebooted (its memory
gone, its local disk kept) resumes from local_dir, every loss equal to the uninterrupted
run's (``cluster.crash_then_resume``); with every node alive, memory still comes first."""

from __future__ import annotations

import pytest

from tests.zephon.memory.cluster import CRASH, STEPS, crash_then_resume
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
