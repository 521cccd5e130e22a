"""Pipeline behaviour: exact passes, provenance, determinism, checkpoint format, restore."""

from __future__ import annotations

import json

import pytest

import zephon
from tests.zephon.pipeline.util import (
    drop_every_7th,
    ids_of,
    keys_of,
    make_dataset,
    simple_pipeline,
)
from zephon.errors import ConfigError
from zephon.pipeline import PipelineError, PipelineStateError


def add_twice(record: dict) -> dict:
    # module level, so worker processes can load it (a lambda would fall back to threads)
    return {**record, "twice": record["n"] * 2}


def full_pipeline(prefetch=None, parallelism=1, drop_last=False, lanes=3, **options):
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=4, per_shard=53), chunk_size=16, seed=11
    )
    p = (
        zephon.Pipeline(source)
        .map_transform(drop_every_7th)
        .shuffle(9, seed=2)
        .map_transform(add_twice)
        .batch(5, drop_last=drop_last)
    )
    if prefetch:
        p.prefetch(prefetch, parallelism=parallelism)
    return p.options(canonical_replicas=lanes, flush_every_k_chunks=2, **options)


def test_a_full_pass_delivers_every_record_exactly_once_including_the_last_partial_chunk():
    dataset = make_dataset(shards=5, per_shard=37)  # 185 records: chunks of 10 leave 5
    p = simple_pipeline(dataset, chunk_size=10, lanes=2, batch=4, drop_last=False)
    ids = ids_of(p)
    assert sorted(ids) == sorted(f"ds-{i}-{j}" for i in range(5) for j in range(37))
    assert len(ids) == len(set(ids)) == 185


def test_the_last_partial_batch_of_each_lane_is_delivered_without_drop_last():
    p = simple_pipeline(make_dataset(shards=1, per_shard=23), chunk_size=10, lanes=1, batch=4)
    sizes = [len(b) for b in p]
    assert sizes == [4, 4, 4, 4, 4, 3]


def test_drop_last_drops_only_each_lanes_final_remainder_and_never_counts_it():
    p = simple_pipeline(
        make_dataset(shards=1, per_shard=23), chunk_size=10, lanes=1, batch=4, drop_last=True
    )
    batches = list(p)
    assert [len(b) for b in batches] == [4] * 5
    state = p.checkpoint()
    assert state["lanes"][0]["batches"] == 5
    q = simple_pipeline(
        make_dataset(shards=1, per_shard=23), chunk_size=10, lanes=1, batch=4, drop_last=True
    )
    q.restore(state)
    assert list(q) == []  # the remainder is dropped again, deterministically


def test_batches_run_across_chunk_and_flush_boundaries():
    p = simple_pipeline(
        make_dataset(shards=1, per_shard=30), chunk_size=7, lanes=1, batch=4, drop_last=True
    )
    assert [len(b) for b in p] == [4] * 7  # 28 of 30: only the curriculum's end is cut


def test_records_carry_payload_and_provenance():
    p = simple_pipeline(make_dataset(shards=2, per_shard=12), chunk_size=5, lanes=2, batch=3)
    records = [r for b in p for r in b]
    for r in records:
        assert isinstance(r, zephon.pipeline.Record)
        _, shard, row = r.sample_id.split("/")
        assert r.payload["id"] == f"ds-{int(shard[1:])}-{row}"
        assert r.chunk % 2 == r.lane  # chunk k goes to lane k % canonical_replicas
        assert 0 <= r.offset < 5
    assert len({(r.chunk, r.offset) for r in records}) == 24


def test_groups_read_one_batch_from_each_owned_lane_in_turn():
    p = simple_pipeline(
        make_dataset(shards=4, per_shard=40),
        chunk_size=10,
        lanes=4,
        batch=5,
        world_size=2,
        dp_degree=2,
        dp_group_id=1,
        aggregate_dir="/unused",
        run_id="r",
    )
    lanes = [b.lane for b in p]
    assert p.owned_lanes == [1, 3]
    assert lanes[:6] == [1, 3, 1, 3, 1, 3]


@pytest.mark.parametrize("prefetch,parallelism", [(None, 1), (1, 1), (7, 1), (3, 4)])
def test_output_is_the_same_for_any_prefetch_depth_or_map_parallelism(prefetch, parallelism):
    reference = [(b.lane, b.payloads, b.keys) for b in full_pipeline()]
    got = [(b.lane, b.payloads, b.keys) for b in full_pipeline(prefetch, parallelism)]
    assert got == reference


def test_checkpoint_is_small_json_and_describes_progress_not_operator_internals():
    p = full_pipeline(prefetch=4)
    it = iter(p)
    for _ in range(7):
        next(it)
    state = p.checkpoint()
    assert json.loads(json.dumps(state)) == state
    assert state["version"] == 1 and state["canonical_replicas"] == 3
    assert [lane["lane"] for lane in state["lanes"]] == [0, 1, 2]
    assert set(state["lanes"][0]) == {
        "lane",
        "flushed_chunks",
        "in_flight_chunks",
        "delivered_since_flush",
        "batches",
    }
    assert sum(lane["batches"] for lane in state["lanes"]) == 7
    assert len(json.dumps(state)) < 1000
    p.close()


def test_prefetched_but_undelivered_batches_are_not_counted():
    p = full_pipeline(prefetch=16)
    it = iter(p)
    next(it)
    import time

    time.sleep(0.2)  # let the prefetch thread run far ahead
    state = p.checkpoint()
    assert sum(lane["batches"] for lane in state["lanes"]) == 1
    p.close()


def test_restore_resumes_exactly_and_reprocesses_only_the_current_window():
    reference = keys_of(full_pipeline())
    p = full_pipeline()
    it = iter(p)
    first = keys_of(next(it) for _ in range(11))
    state = p.checkpoint()
    q = full_pipeline(prefetch=2)
    q.restore(state)
    assert first + keys_of(q) == reference
    for lane in state["lanes"]:
        assert lane["flushed_chunks"] % 2 == 0 and lane["in_flight_chunks"] <= 2


def test_checkpoint_right_after_restore_equals_the_restored_state():
    p = full_pipeline()
    it = iter(p)
    for _ in range(5):
        next(it)
    state = p.checkpoint()
    q = full_pipeline()
    q.restore(state)
    assert q.checkpoint() == state


def test_a_new_iteration_continues_from_delivered_progress():
    reference = keys_of(full_pipeline())
    p = full_pipeline(prefetch=8)
    it = iter(p)
    first = keys_of(next(it) for _ in range(4))
    rest = keys_of(p)  # prefetched-but-undelivered work is produced again
    assert first + rest == reference
    with pytest.raises(PipelineError, match="iterate the pipeline again"):
        next(it)


def test_restore_takes_effect_when_iteration_starts():
    p = full_pipeline()
    reference = keys_of(full_pipeline())
    it = iter(p)
    for _ in range(3):
        next(it)
    q = full_pipeline()
    q.restore(p.checkpoint())
    assert keys_of(q)[:5] == reference[15:20]


def test_flush_defaults_to_8_when_reordering_and_0_otherwise():
    assert simple_pipeline().flush_every_k_chunks == 0
    assert simple_pipeline(shuffle=4).flush_every_k_chunks == 8
    source = zephon.StaticMixtureWorkSource(make_dataset(), chunk_size=5)
    packed = zephon.Pipeline(source).map_transform(lambda r: [1] * (r["n"] % 5 + 1))
    assert packed.pack_sequences(8).batch(2).flush_every_k_chunks == 8


def test_explicit_flush_0_with_a_reordering_operator_is_an_error():
    with pytest.raises(ConfigError, match="flush_every_k_chunks=0 is not allowed"):
        list(simple_pipeline(shuffle=4, flush=0))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda p: p.batch(0), "microbatch_size must be an integer >= 1, got 0"),
        (lambda p: p.shuffle(-1), "shuffle buffer_size must be an integer >= 1, got -1"),
        (lambda p: p.map_transform("nope"), "map_transform fn must be callable"),
        (lambda p: p.pack_sequences(8, overflow="wrap"), "overflow must be 'truncate' or 'error'"),
        (lambda p: p.prefetch(0), "prefetch buffer_size must be an integer >= 1, got 0"),
        (lambda p: iter(p.batch(2).options(world_size=2)), "world_size=2 needs a way to assemble"),
        (lambda p: p.options(world_size=2, aggregate_dir="/x"), "run_id is required"),
        (lambda p: p.options(world_size=2, aggregate_dir="/x", run_id="a b"), "run_id must be"),
        (
            lambda p: p.options(global_rank=3),
            r"global_rank must be in range\(world_size=1\), got 3",
        ),
        (
            lambda p: p.options(
                world_size=4, dp_degree=2, dp_group_id=2, aggregate_dir="/x", run_id="r"
            ),
            r"dp_group_id must be in range\(dp_degree=2\), got 2",
        ),
        (
            lambda p: p.options(
                world_size=4, dp_degree=3, canonical_replicas=8, aggregate_dir="/x", run_id="r"
            ),
            "canonical_replicas=8 must be divisible by dp_degree=3",
        ),
        (lambda p: p.options(aggregate_timeout_s=0), "aggregate_timeout_s must be a number > 0"),
        (lambda p: p.batch(2).map_transform(len), "must come before batch()"),
    ],
)
def test_invalid_arguments_name_the_parameter_the_value_and_what_is_allowed(call, match):
    p = zephon.Pipeline(zephon.StaticMixtureWorkSource(make_dataset()))
    with pytest.raises(ConfigError, match=match):
        call(p)


def test_the_configuration_is_frozen_once_the_pipeline_started():
    p = simple_pipeline()
    iter(p)
    with pytest.raises(ConfigError, match="after the pipeline started"):
        p.shuffle(3)
    p.close()


def test_iterating_without_batch_says_what_to_call():
    p = zephon.Pipeline(zephon.StaticMixtureWorkSource(make_dataset()))
    with pytest.raises(ConfigError, match=r"call \.batch\(microbatch_size\)"):
        iter(p)


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda s: s.update(version=2), "version"),
        (lambda s: s.update(format="other"), "format"),
        (lambda s: s.update(canonical_replicas=6), "canonical_replicas"),
        (lambda s: s.update(flush_every_k_chunks=4), "flush_every_k_chunks"),
        (lambda s: s.update(work_source="0" * 16), "work_source"),
        (lambda s: s.update(operators="map(drop_none=True)"), "operators"),
        (lambda s: s.update(lanes=s["lanes"][:2]), "lanes"),
        (lambda s: s["lanes"][1].update(batches=-1), "lanes[1].batches"),
        (
            lambda s: s["lanes"][2].update(delivered_since_flush="7"),
            "lanes[2].delivered_since_flush",
        ),
        (lambda s: s["lanes"][0].update(flushed_chunks=3), "lanes[0].flushed_chunks"),
        (lambda s: s["lanes"][0].update(lane=2), "lanes[0].lane"),
        (lambda s: s["lanes"].__setitem__(1, []), "lanes[1]"),
    ],
)
def test_restore_validates_at_once_and_names_the_field(mutate, field):
    p = full_pipeline()
    state = json.loads(json.dumps(p.checkpoint()))
    mutate(state)
    q = full_pipeline()
    with pytest.raises(PipelineStateError) as info:
        q.restore(state)
    assert info.value.field == field
    assert field in str(info.value)


def test_restore_refuses_a_changed_canonical_replicas_naming_the_field():
    state = full_pipeline(lanes=3).checkpoint()
    with pytest.raises(PipelineStateError, match="canonical_replicas is 3, expected 6"):
        full_pipeline(lanes=6).restore(state)


def test_restore_refuses_something_that_is_not_a_state_dict():
    with pytest.raises(PipelineStateError, match="checkpoint"):
        full_pipeline().restore(["not", "a", "dict"])


def test_microbatch_size_may_change_between_runs():
    reference = keys_of(simple_pipeline(shuffle=6, batch=4))
    p = simple_pipeline(shuffle=6, batch=4)
    it = iter(p)
    first = keys_of(next(it) for _ in range(9))
    q = simple_pipeline(shuffle=6, batch=6)
    q.restore(p.checkpoint())

    # the interleaving of lanes follows the batch size; each lane's record stream does not
    def per_lane(keys):
        return [[k for k in keys if k[0] == lane] for lane in (0, 1)]

    resumed = first + keys_of(q)
    assert per_lane(resumed) == per_lane(reference)
    assert sorted(resumed) == sorted(reference)


def test_stop_after_passes_repeats_the_data_with_a_new_shard_order():
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=6, per_shard=10), chunk_size=10, seed=1, stop_after_passes=2
    )
    ids = ids_of(zephon.Pipeline(source).batch(10, drop_last=False))
    assert len(ids) == 120 and sorted(ids[:60]) == sorted(ids[60:]) and ids[:60] != ids[60:]


def test_pack_sequences_packs_first_fit_and_keeps_every_token():
    rows = [{"tokens": list(range(n))} for n in [5, 3, 6, 2, 4, 1, 7, 2]]
    ds = zephon.Dataset.from_dict("tok", {"a": zephon.InMemoryShard(rows)})
    source = zephon.StaticMixtureWorkSource(ds, chunk_size=8, shuffle_shards=False)
    p = zephon.Pipeline(source).pack_sequences(8).batch(1, drop_last=False)
    records = [r for b in p for r in b]
    lengths = [r.payload["segment_lengths"] for r in records]
    # first fit: 5 -> bin0, 3 -> bin0 (full), 6 -> bin1, 2 -> bin1, 4 -> bin2, 1 -> bin2, ...
    assert lengths == [[5, 3], [6, 2], [4, 1, 2], [7]]
    assert sum(len(r.payload["tokens"]) for r in records) == 30
    assert [m[2] for m in records[2].members] == ["tok/a/4", "tok/a/5", "tok/a/7"]


def test_pack_sequences_overflow_error_names_the_limit():
    ds = zephon.Dataset.from_dict("tok", {"a": zephon.InMemoryShard([list(range(20))])})
    p = zephon.Pipeline(zephon.StaticMixtureWorkSource(ds)).pack_sequences(8, overflow="error")
    with pytest.raises(PipelineError, match="20 tokens exceeds max_length=8"):
        list(p.batch(1))


def test_a_failing_map_function_surfaces_in_the_training_loop_with_prefetch():
    def boom(record):
        raise RuntimeError("bad record")

    p = simple_pipeline()
    p = zephon.Pipeline(zephon.StaticMixtureWorkSource(make_dataset())).map_transform(boom)
    p.batch(2).prefetch(2)
    with pytest.raises(RuntimeError, match="bad record"):
        list(p)
