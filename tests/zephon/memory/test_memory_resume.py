"""Resuming from the memory tier on two simulated nodes, real ``torchrun`` processes
(docs/memory.md, "Resuming from memory"): from the job's own memory, from a peer's copy when a
node is lost, from save_dir when both are; every loss equal to the uninterrupted run's
(``cluster.crash_then_resume``)."""

from __future__ import annotations

import pytest

from tests.zephon.memory.cluster import CRASH, crash_then_resume

pytestmark = pytest.mark.slow


def test_a_job_restarting_with_every_node_alive_resumes_from_its_own_memory(tmp_path):
    start, log = crash_then_resume(tmp_path, [tmp_path / "m0", tmp_path / "m1"])
    assert start["step"] == CRASH and "/.resume/" in start["url"], log
    assert "assembled from own memory" in log, log


def test_a_lost_node_is_replaced_from_its_peer_copy(tmp_path):
    start, log = crash_then_resume(tmp_path, [tmp_path / "m0", tmp_path / "m1"], lose=[1])
    assert start["step"] == CRASH and "/.resume/" in start["url"], log
    assert "MiB from peers" in log, log


def test_two_adjacent_lost_nodes_fall_back_to_save_dir(tmp_path):
    start, log = crash_then_resume(
        tmp_path, [tmp_path / "m0", tmp_path / "m1"], lose=[0, 1], strip=False
    )
    assert start["step"] == CRASH and "/.resume/" not in start["url"], log
    assert start["url"].startswith(str(tmp_path / "save_dir")), start


def test_two_nodes_of_two_ranks_resume_a_lost_node_and_upload_what_save_dir_missed(tmp_path):
    start, log = crash_then_resume(
        tmp_path, [tmp_path / "m0", tmp_path / "m1"], lose=[0], nproc=2, unupload=True
    )
    assert start["step"] == CRASH and "MiB from peers" in log, log
    # newer than save_dir's latest: the new attempt uploaded it, from the assembled copy
    from zephon.storage import CheckpointStore

    run = CheckpointStore(str(tmp_path / "save_dir")).run("mem")
    assert CRASH in run.committed_steps() and run.verify(CRASH, deep=True).ok
