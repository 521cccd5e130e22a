"""Elastic resumption: 8 lanes, 4 groups -> 2 -> 8, global steps equal to the 4-group run."""

from __future__ import annotations

import pytest

import zephon
from tests.zephon.pipeline.agg_worker import checkpoint_all  # every rank at once, one state
from tests.zephon.pipeline.util import make_dataset
from zephon.errors import ConfigError
from zephon.pipeline import PipelineStateError

LANES = 8
MICROBATCH = 3
GLOBAL_BATCH = 48  # every lane gives 6 records (2 microbatches) per optimizer step


def group_pipeline(
    source: zephon.StaticMixtureWorkSource,
    rank: int,
    groups: int,
    agg: str,
    *,
    shuffle: tuple[int, int],
    microbatch: int,
    lanes: int,
    run_id: str,
) -> zephon.Pipeline:
    """Group ``rank``'s pipeline (one rank per data-parallel group) of a run with ``lanes``
    lanes: ``source``, shuffled with (buffer, seed), in microbatches, checkpoints assembled in
    ``agg``."""
    buffer, seed = shuffle
    return (
        zephon.Pipeline(source)
        .map_transform(lambda r: r)
        .shuffle(buffer, seed=seed)
        .batch(microbatch)
        .options(
            world_size=groups,
            global_rank=rank,
            dp_degree=groups,
            dp_group_id=rank,
            canonical_replicas=lanes,
            aggregate_dir=agg,
            run_id=run_id,
            aggregate_timeout_s=10,
            flush_every_k_chunks=2,
        )
    )


def build(rank: int, groups: int, agg: str, lanes: int = LANES) -> zephon.Pipeline:
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=6, per_shard=97), chunk_size=11, seed=4
    )
    return group_pipeline(
        source,
        rank,
        groups,
        agg,
        shuffle=(7, 1),
        microbatch=MICROBATCH,
        lanes=lanes,
        run_id="elastic",
    )


def topology(groups: int, agg: str, state: dict | None = None, make=build) -> list[zephon.Pipeline]:
    """Every group's pipeline from ``make(rank, groups, agg)``, restored from ``state`` if given."""
    pipelines = [make(rank, groups, agg) for rank in range(groups)]
    if state is not None:
        for p in pipelines:
            p.restore(state)
    return pipelines


def run_steps(
    pipelines,
    steps: int | None,
    *,
    lanes: int = LANES,
    microbatch: int = MICROBATCH,
    global_batch: int = GLOBAL_BATCH,
) -> list[list[tuple]]:
    """Each optimizer step: every group takes its microbatches; a step's records, sorted."""
    zephon.check_elastic_config(lanes, len(pipelines), microbatch, global_batch_size=global_batch)
    per_group = global_batch // (len(pipelines) * microbatch)
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


# -- an endless curriculum (exhausted_policy="repeat"): 4 lanes, dp 4 -> 2 -> 1 -----------------

ENDLESS_LANES = 4
ENDLESS_MICROBATCH = 2
ENDLESS_GLOBAL_BATCH = 16  # 4 records (2 microbatches) per lane and optimizer step
ENDLESS_STEPS = 30  # 480 records: twelve passes over the 39-record dataset


def build_endless(rank: int, groups: int, agg: str) -> zephon.Pipeline:
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=3, per_shard=13), chunk_size=5, seed=8, exhausted_policy="repeat"
    )
    return group_pipeline(
        source,
        rank,
        groups,
        agg,
        shuffle=(4, 3),
        microbatch=ENDLESS_MICROBATCH,
        lanes=ENDLESS_LANES,
        run_id="endless",
    )


def endless_steps(groups: int, agg: str, steps: int, state: dict | None = None):
    pipelines = topology(groups, agg, state, make=build_endless)
    got = run_steps(
        pipelines,
        steps,
        lanes=ENDLESS_LANES,
        microbatch=ENDLESS_MICROBATCH,
        global_batch=ENDLESS_GLOBAL_BATCH,
    )
    return got, pipelines


@pytest.mark.parametrize("cuts", [(2, 9), (5, 6), (7, 19)])
def test_elastic_resume_continues_exactly_across_repeats(tmp_path, cuts):
    agg = str(tmp_path / "agg")
    reference, _ = endless_steps(4, agg, ENDLESS_STEPS)
    assert len(reference) == ENDLESS_STEPS
    source = build_endless(0, 1, agg)._source
    passes = {source.chunk(chunk).pass_index for step in reference for _, chunk, _ in step}
    assert len(passes) >= 12  # the run went round the dataset a dozen times

    steps, four = endless_steps(4, agg, cuts[0])
    more, two = endless_steps(2, agg, cuts[1] - cuts[0], checkpoint_all(four))
    steps += more
    rest, _ = endless_steps(1, agg, ENDLESS_STEPS - cuts[1], checkpoint_all(two))
    steps += rest
    assert steps == reference
