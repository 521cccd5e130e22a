"""The curriculum: chunks, passes, mixtures, determinism, argument errors."""

from __future__ import annotations

import pytest

import zephon
from tests.zephon.pipeline.util import make_dataset
from zephon.errors import ConfigError


def chunks(source) -> list:
    out, k = [], 0
    while (c := source.chunk(k)) is not None:
        out.append(c)
        k += 1
    return out


def test_chunks_cover_a_pass_exactly_and_keep_the_last_partial_chunk():
    source = zephon.StaticMixtureWorkSource(make_dataset(shards=3, per_shard=10), chunk_size=4)
    got = chunks(source)
    assert [c.size for c in got] == [4] * 7 + [2]
    covered = sorted(
        (shard, row) for c in got for shard, start, stop in c.segments for row in range(start, stop)
    )
    assert covered == [(f"s{i:03d}", r) for i in range(3) for r in range(10)]


def test_chunks_may_span_shard_boundaries():
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=2, per_shard=3), chunk_size=4, shuffle_shards=False
    )
    assert chunks(source)[0].segments == (("s000", 0, 3), ("s001", 0, 1))


def test_the_curriculum_is_the_same_for_the_same_configuration_and_seed_dependent():
    def plan(seed):
        src = zephon.StaticMixtureWorkSource(make_dataset(shards=8), chunk_size=5, seed=seed)
        return [c.segments for c in chunks(src)]

    assert plan(1) == plan(1)
    assert plan(1) != plan(2)


def test_mixture_weights_set_each_datasets_share_of_records():
    a = make_dataset("a", shards=2, per_shard=500)
    b = make_dataset("b", shards=2, per_shard=500)
    source = zephon.StaticMixtureWorkSource(
        [a, b], {"a": 3, "b": 1}, chunk_size=10, stop_after_passes=None
    )
    first = [source.chunk(k).dataset for k in range(80)]
    assert first.count("a") == 60 and first.count("b") == 20


def test_a_dataset_that_finished_its_passes_leaves_the_mixture():
    a = make_dataset("a", shards=1, per_shard=20)
    b = make_dataset("b", shards=1, per_shard=100)
    source = zephon.StaticMixtureWorkSource([a, b], [1, 1], chunk_size=10)
    names = [c.dataset for c in chunks(source)]
    assert names.count("a") == 2 and names.count("b") == 10
    assert names[-6:] == ["b"] * 6


def test_without_a_mixture_datasets_are_weighted_by_size():
    a = make_dataset("a", shards=1, per_shard=30)
    b = make_dataset("b", shards=1, per_shard=90)
    names = [c.dataset for c in chunks(zephon.StaticMixtureWorkSource([a, b], chunk_size=10))]
    assert names[:4].count("a") == 1 and names[-1] == "b" and names.count("a") == 3


def test_endless_curriculum_with_stop_after_passes_none():
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=1, per_shard=10), chunk_size=10, stop_after_passes=None
    )
    assert [source.chunk(k).pass_index for k in range(5)] == [0, 1, 2, 3, 4]


def test_sample_ids_name_dataset_shard_and_row():
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=2, per_shard=3), chunk_size=4, shuffle_shards=False
    )
    c = source.chunk(0)
    assert [c.sample_id(i) for i in range(4)] == [
        "ds/s000/0",
        "ds/s000/1",
        "ds/s000/2",
        "ds/s001/0",
    ]


def test_the_fingerprint_changes_when_the_data_changes():
    one = zephon.StaticMixtureWorkSource(make_dataset(per_shard=10)).fingerprint()
    assert one == zephon.StaticMixtureWorkSource(make_dataset(per_shard=10)).fingerprint()
    assert one != zephon.StaticMixtureWorkSource(make_dataset(per_shard=11)).fingerprint()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"chunk_size": 0}, "chunk_size must be an integer >= 1, got 0"),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"stop_after_passes": 0}, "stop_after_passes must be an integer >= 1 or None, got 0"),
        ({"shuffle_shards": "yes"}, "shuffle_shards must be True or False"),
        ({"mixture": [1, 2]}, r"one weight per dataset \(1\), got 2"),
        ({"mixture": {"other": 1}}, "mixture keys must be exactly the dataset names"),
        ({"mixture": [0]}, "mixture weight for dataset 'ds' must be a finite number > 0, got 0"),
    ],
)
def test_invalid_arguments_name_the_parameter(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        zephon.StaticMixtureWorkSource(make_dataset(), **kwargs)


def test_datasets_must_have_distinct_names():
    with pytest.raises(ConfigError, match="distinct names"):
        zephon.StaticMixtureWorkSource([make_dataset("x"), make_dataset("x")])


def test_planning_keeps_a_bounded_cache_and_replans_older_chunks_identically(monkeypatch):
    from zephon.pipeline import work_source

    def plan():
        return zephon.StaticMixtureWorkSource(
            make_dataset(shards=5, per_shard=40), chunk_size=3, seed=9, stop_after_passes=3
        )

    expected = chunks(plan())
    monkeypatch.setattr(work_source, "_RECENT_CHUNKS", 4)
    source = plan()
    for k in [50, 3, 51, 0, 199, 7, len(expected) - 1, len(expected), 2]:
        got = source.chunk(k)
        assert got == (expected[k] if k < len(expected) else None)
    assert len(source._recent) <= 4
    # a whole pipeline over the small cache gives the same records
    p = zephon.Pipeline(source).shuffle(4).batch(5, drop_last=False).options(canonical_replicas=3)
    assert len([r for b in p for r in b]) == 600
