"""Elastic resumption: 8 lanes, 4 groups -> 2 -> 8, global steps equal to the 4-group run."""

from __future__ import annotations

import pytest

import zephon
from tests.zephon.pipeline.util import make_dataset
from zephon.errors import ConfigError
from zephon.pipeline import PipelineStateError

LANES = 8
MICROBATCH = 3
GLOBAL_BATCH = 48  # every lane gives 6 records (2 microbatches) per optimizer step


def build(rank: int, groups: int, agg: str, lanes: int = LANES) -> zephon.Pipeline:
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=6, per_shard=97), chunk_size=11, seed=4
    )
    return (
        zephon.Pipeline(source)
        .map_transform(lambda r: r)
        .shuffle(7, seed=1)
        .batch(MICROBATCH)
        .options(
            world_size=groups,
            global_rank=rank,
            dp_degree=groups,
            dp_group_id=rank,
            canonical_replicas=lanes,
            aggregate_dir=agg,
            run_id="elastic",
            aggregate_timeout_s=10,
            flush_every_k_chunks=2,
        )
    )


def topology(groups: int, agg: str, state: dict | None = None) -> list[zephon.Pipeline]:
    pipelines = [build(rank, groups, agg) for rank in range(groups)]
    if state is not None:
        for p in pipelines:
            p.restore(state)
    return pipelines


def run_steps(pipelines, steps: int | None) -> list[list[tuple]]:
    """Each optimizer step: every group takes its microbatches; a step's records, sorted."""
    zephon.check_elastic_config(LANES, len(pipelines), MICROBATCH, global_batch_size=GLOBAL_BATCH)
    per_group = GLOBAL_BATCH // (len(pipelines) * MICROBATCH)
    iterators = [iter(p) for p in pipelines]
    out = []
    while steps is None or len(out) < steps:
        step = []
        for it in iterators:
            for _ in range(per_group):
                batch = next(it, None)
                if batch is None:
                    return out
                step.extend(batch.keys)
        out.append(sorted(step))
    return out


def checkpoint_all(pipelines) -> dict:
    """Every rank checkpoints at the same step; rank 0 (last here) assembles the state."""
    for p in pipelines[1:]:
        assert p.checkpoint() is None
    return pipelines[0].checkpoint()


def test_elastic_resume_4_to_2_to_8_groups_keeps_every_global_step(tmp_path):
    agg = str(tmp_path / "agg")
    reference = run_steps(topology(4, agg), None)
    assert len(reference) >= 8

    four = topology(4, agg)
    steps = run_steps(four, 3)
    state = checkpoint_all(four)

    two = topology(2, agg, state)
    steps += run_steps(two, 2)
    state = checkpoint_all(two)

    eight = topology(8, agg, state)
    steps += run_steps(eight, None)

    assert steps[: len(reference)] == reference
    assert sorted(k for s in steps for k in s) == sorted(k for s in reference for k in s)


def test_restore_on_another_dp_degree_reassigns_lanes(tmp_path):
    four = topology(4, str(tmp_path))
    assert [p.owned_lanes for p in four] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    two = topology(2, str(tmp_path), checkpoint_all(four))
    assert [p.owned_lanes for p in two] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_a_changed_canonical_replicas_is_refused_naming_the_field(tmp_path):
    state = checkpoint_all(topology(4, str(tmp_path)))
    with pytest.raises(PipelineStateError) as info:
        build(0, 4, str(tmp_path), lanes=4).restore(state)
    assert info.value.field == "canonical_replicas"


@pytest.mark.parametrize(
    "args,kwargs,rule",
    [
        ((8, 3, 2), {"microbatches_per_step": 3}, "rule 1"),
        ((8, 4, 2), {"microbatches_per_step": 3}, "rule 2"),
        ((8, 2, 4), {"global_batch_size": 48}, "rule 2"),  # 6 records per lane, microbatch 4
        ((8, 4, 3), {"global_batch_size": 50}, "not a whole number of microbatches"),
        ((8, 4, 3), {"global_batch_size": 48, "microbatches_per_step": 2}, "disagrees"),
        ((8, 4, 3), {}, "needs microbatches_per_step"),
        ((0, 4, 3), {"microbatches_per_step": 2}, "canonical_replicas must be an integer >= 1"),
    ],
)
def test_check_elastic_config_names_the_broken_rule(args, kwargs, rule):
    with pytest.raises(ConfigError, match=rule):
        zephon.check_elastic_config(*args, **kwargs)


@pytest.mark.parametrize("groups,steps", [(1, 8), (2, 4), (4, 2), (8, 1), (8, 3)])
def test_check_elastic_config_accepts_whole_rounds(groups, steps):
    assert zephon.check_elastic_config(8, groups, 3, microbatches_per_step=steps) is None
