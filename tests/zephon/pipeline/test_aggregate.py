"""Distributed checkpoints assembled through aggregate_dir: every rank gets the merged state."""

from __future__ import annotations

import json

import fsspec
import pytest

from tests.conftest import backends_with
from tests.ranks import launch
from tests.zephon.pipeline.agg_worker import build, checkpoint_all, checkpoint_together, states_at
from zephon.pipeline import AggregationTimeoutError


def _backend(request, name: str):
    return request.getfixturevalue(f"{name}_backend")


def _expected_states(tmp_path, checkpoints, world_size, dp_degree) -> list[dict]:
    """The same ranks in one process, one thread each at a checkpoint: the merged states."""
    url = str(tmp_path / "expected")
    pipelines = [
        build(r, world_size, dp_degree, url, {}, "expected", 10) for r in range(world_size)
    ]
    return states_at(pipelines, checkpoints)


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", backends_with(cross_process=True, one_winner_races=True))
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
    # ... and a merged state under that key from the same earlier attempt, at a position the
    # live ranks also reach: without their nonces, no rank may take it for theirs.
    leftover = {"format": "zephon.pipeline.merged", "token": "t", "nonces": ["x"] * 4}
    for key, name, data in [
        ("fresh-00000000", "rank-000001.json", json.dumps(stale).encode()),
        ("fresh-00000000", "merged.json", json.dumps({**leftover, "state": {}}).encode()),
        ("0123456789abcdef-00000003", "rank-000002.json", b"{}"),
    ]:
        fs.makedirs(f"{run_dir}/{key}", exist_ok=True)
        fs.pipe_file(f"{run_dir}/{key}/{name}", data)

    checkpoints = [2, 5]
    config = {
        "dp_degree": 2,
        "url": backend.url,
        "storage_options": backend.storage_options,
        "run_id": "run-a",
        "checkpoints": checkpoints,
        "timeout": 180,  # ranks start far apart on a loaded machine: every rank waits now
    }
    results = launch("tests.zephon.pipeline.agg_worker", 4, config)

    expected = _expected_states(tmp_path, checkpoints, 4, 2)
    for rank in range(4):  # every rank returns the same merged state, byte for byte
        assert json.dumps(results[rank]["states"]) == json.dumps(expected)
        # and a pipeline restored from it on any rank continues exactly
        assert results[rank]["restored"] == results[rank]["after"]
    final = expected[-1]
    assert [lane["batches"] for lane in final["lanes"]] == [3, 3, 2, 2]
    # ranks of one group (0 and 1, 2 and 3) read the same lanes
    assert results[0]["keys"] == results[1]["keys"]
    assert results[2]["keys"] == results[3]["keys"]
    fs.invalidate_cache()
    assert not fs.exists(run_dir) or fs.ls(run_dir, detail=False) == []


def test_a_rank_that_never_arrives_is_named_by_every_rank_that_waited(tmp_path):
    url = str(tmp_path / "agg")
    # rank 1 never calls checkpoint(); ranks 0, 2 and 3 do, each after one batch
    ranks = {r: build(r, 4, 2, url, {}, "run-b", 2) for r in (0, 2, 3)}
    for p in ranks.values():
        next(iter(p))
    errors = dict(zip(ranks, checkpoint_together(list(ranks.values())), strict=True))
    for p in ranks.values():
        p.close()
    for rank, error in errors.items():
        assert isinstance(error, AggregationTimeoutError), (rank, error)
        assert error.missing_ranks == [1] and error.timeout_s == 2
        assert "ranks [1] did not write their part" in str(error)
        assert "\n" not in str(error)


def test_a_rank_0_that_never_arrives_is_named_by_the_others(tmp_path):
    url = str(tmp_path / "agg")
    others = [build(r, 3, 1, url, {}, "run-f", 1) for r in (1, 2)]
    errors = checkpoint_together(others)
    assert [e.missing_ranks for e in errors] == [[0], [0]]
    assert "ranks [0] did not write their part" in str(errors[0])


def test_timeout_on_s3_names_every_missing_rank(s3_backend):
    ranks = [
        build(r, 3, 1, s3_backend.url, s3_backend.storage_options, "run-c", 1.5) for r in (0, 2)
    ]
    errors = checkpoint_together(ranks)
    assert [e.missing_ranks for e in errors] == [[1], [1]]
    assert all("s3://" in str(e) and "testing" not in str(e) for e in errors)


def test_a_leftover_part_at_another_position_is_named_when_its_rank_never_comes(tmp_path):
    url = str(tmp_path / "agg")
    rank1 = build(1, 2, 2, url, {}, "run-d", 1)
    it = iter(rank1)
    next(it)
    # rank 1 leaves a part at "1 batch delivered" and gives up; rank 0 has delivered nothing
    assert isinstance(checkpoint_together([rank1])[0], AggregationTimeoutError)
    rank0 = build(0, 2, 2, url, {}, "run-d", 1)
    with pytest.raises(AggregationTimeoutError, match="at another position"):
        rank0.checkpoint()
    rank1.close()


@pytest.mark.parametrize("url", ["memory://zephon-agg-test", "local"])
def test_consecutive_checkpoints_give_every_rank_the_state_and_leave_nothing(tmp_path, url):
    url = str(tmp_path / "agg") if url == "local" else url
    ranks = [build(r, 4, 4, url, {}, "run-e", 10) for r in range(4)]
    iterators = [iter(p) for p in ranks]
    states = []
    for _ in range(3):
        for it in iterators:
            next(it)
        states.append(checkpoint_all(ranks))
        fs, root = fsspec.core.url_to_fs(url)
        fs.invalidate_cache()
        # the last rank to read the merged state removed the key
        assert fs.find(f"{root}/run-e") == []
    assert [sum(lane["batches"] for lane in s["lanes"]) for s in states] == [4, 8, 12]
    for p in ranks:
        p.close()


def test_restore_from_the_state_of_any_rank_gives_the_same_next_checkpoint(tmp_path):
    url = str(tmp_path / "agg")
    ranks = [build(r, 2, 2, url, {}, "run-g", 10) for r in range(2)]
    iterators = [iter(p) for p in ranks]
    for it in iterators:
        next(it)
    states = checkpoint_together(ranks)
    for p, state in zip(ranks, states, strict=True):
        p.restore(state)  # each rank its own copy, as a job restoring on every rank does
    iterators = [iter(p) for p in ranks]
    for it in iterators:
        next(it)
    again = checkpoint_all(ranks)
    assert [lane["batches"] for lane in again["lanes"]] == [1, 1, 1, 1]
    for p in ranks:
        p.close()
