"""Distributed checkpoints assembled through aggregate_dir by separate processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fsspec
import pytest

from tests.zephon.pipeline.agg_worker import build
from zephon.pipeline import AggregationTimeoutError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _backend(request, name: str):
    return request.getfixturevalue(f"{name}_backend")


def _spawn(args: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.zephon.pipeline.agg_worker", json.dumps(args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_ranks(ranks, **common) -> dict[int, dict]:
    procs = {rank: _spawn({**common, "rank": rank}) for rank in ranks}
    results = {}
    for rank, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"rank {rank} failed:\n{err}"
        results[rank] = json.loads(out.strip().splitlines()[-1])
    return results


def _expected_states(tmp_path, checkpoints, world_size, dp_degree) -> list[dict]:
    """The same ranks in one process, in turn: what the merged states must be."""
    url = str(tmp_path / "expected")
    pipelines = [
        build(r, world_size, dp_degree, url, {}, "expected", 10) for r in range(world_size)
    ]
    iterators = [iter(p) for p in pipelines]
    states, done = [], 0
    for target in checkpoints:
        for it in iterators:
            for _ in range(target - done):
                next(it)
        done = target
        for p in pipelines[1:]:
            assert p.checkpoint() is None
        states.append(pipelines[0].checkpoint())
    for p in pipelines:
        p.close()
    return states


@pytest.mark.parametrize("backend_name", ["local", "s3"])
def test_separate_processes_assemble_one_state_and_leave_nothing_behind(
    request, tmp_path, backend_name
):
    backend = _backend(request, backend_name)
    fs, root = fsspec.core.url_to_fs(backend.url, **backend.storage_options)
    run_dir = f"{root}/run-a"
    # Leftovers of an earlier attempt: one under the very key the first checkpoint will use
    # but at another position, one under another epoch. Neither may mix in.
    stale = {
        "format": "zephon.pipeline.part",
        "version": 1,
        "rank": 1,
        "delivered": 999,
        "lanes": [
            {
                "lane": 0,
                "flushed_chunks": 0,
                "in_flight_chunks": 0,
                "delivered_since_flush": 77,
                "batches": 77,
            }
        ],
    }
    for key, rank, data in [
        ("fresh-00000000", 1, json.dumps(stale).encode()),
        ("0123456789abcdef-00000003", 2, b"{}"),
    ]:
        fs.makedirs(f"{run_dir}/{key}", exist_ok=True)
        fs.pipe_file(f"{run_dir}/{key}/rank-00000{rank}.json", data)

    checkpoints = [2, 5]
    results = _run_ranks(
        range(4),
        world_size=4,
        dp_degree=2,
        url=backend.url,
        storage_options=backend.storage_options,
        run_id="run-a",
        checkpoints=checkpoints,
        timeout=60,
    )

    assert all(s is None for r in (1, 2, 3) for s in results[r]["states"])
    assert results[0]["states"] == _expected_states(tmp_path, checkpoints, 4, 2)
    final = results[0]["states"][-1]
    assert [lane["batches"] for lane in final["lanes"]] == [3, 3, 2, 2]
    # ranks of one group (0 and 1, 2 and 3) read the same lanes
    assert results[0]["keys"] == results[1]["keys"]
    assert results[2]["keys"] == results[3]["keys"]
    fs.invalidate_cache()
    assert not fs.exists(run_dir) or fs.ls(run_dir, detail=False) == []


def test_a_rank_that_never_arrives_fails_rank_0_naming_it(request, tmp_path):
    backend = _backend(request, "local")
    # ranks 2 and 3 run as processes and write their parts; rank 1 never starts
    _run_ranks(
        (2, 3),
        world_size=4,
        dp_degree=2,
        url=backend.url,
        storage_options={},
        run_id="run-b",
        checkpoints=[1],
        timeout=60,
    )
    rank0 = build(0, 4, 2, backend.url, {}, "run-b", 2)
    next(iter(rank0))
    with pytest.raises(AggregationTimeoutError) as info:
        rank0.checkpoint()
    rank0.close()
    assert info.value.missing_ranks == [1]
    assert "ranks [1] did not write their part" in str(info.value)
    assert info.value.timeout_s == 2


def test_timeout_on_s3_names_every_missing_rank(s3_backend):
    rank2 = build(2, 3, 1, s3_backend.url, s3_backend.storage_options, "run-c", 1.5)
    rank0 = build(0, 3, 1, s3_backend.url, s3_backend.storage_options, "run-c", 1.5)
    assert rank2.checkpoint() is None
    with pytest.raises(AggregationTimeoutError) as info:
        rank0.checkpoint()
    assert info.value.missing_ranks == [1]
    assert "s3://" in str(info.value) and "testing" not in str(info.value)


def test_a_leftover_part_at_another_position_is_named_when_its_rank_never_comes(tmp_path):
    url = str(tmp_path / "agg")
    rank1 = build(1, 2, 2, url, {}, "run-d", 1)
    it = iter(rank1)
    next(it)
    assert rank1.checkpoint() is None  # a part at "1 batch delivered"
    rank0 = build(0, 2, 2, url, {}, "run-d", 1)  # rank 0 delivered nothing
    with pytest.raises(AggregationTimeoutError, match="at another position"):
        rank0.checkpoint()
    rank1.close()


@pytest.mark.parametrize("url", ["memory://zephon-agg-test", "local"])
def test_consecutive_checkpoints_use_new_keys_and_clean_up_older_ones(tmp_path, url):
    url = str(tmp_path / "agg") if url == "local" else url
    ranks = [build(r, 2, 2, url, {}, "run-e", 10) for r in range(2)]
    iterators = [iter(p) for p in ranks]
    states = []
    for _ in range(3):
        for it in iterators:
            next(it)
        assert ranks[1].checkpoint() is None
        states.append(ranks[0].checkpoint())
    assert [sum(lane["batches"] for lane in s["lanes"]) for s in states] == [2, 4, 6]
    fs, root = fsspec.core.url_to_fs(url)
    assert fs.find(f"{root}/run-e") == []
    for p in ranks:
        p.close()
