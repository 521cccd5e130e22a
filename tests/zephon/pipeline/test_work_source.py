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


# -- MixtureSpec ----------------------------------------------------------------------------------


def test_a_mixture_spec_plans_what_the_same_dict_or_list_plans():
    a = make_dataset("a", shards=2, per_shard=50)
    b = make_dataset("b", shards=3, per_shard=40)

    def source(mixture):
        return zephon.StaticMixtureWorkSource([a, b], mixture, chunk_size=7, seed=5)

    spec = source(zephon.MixtureSpec({"b": 1, "a": 3}))
    for other in (source({"a": 3, "b": 1}), source([3, 1])):
        assert other.fingerprint() == spec.fingerprint()
        assert chunks(other) == chunks(spec)
    first = [c.dataset for c in chunks(spec)][:16]
    assert first.count("a") == 12 and first.count("b") == 4  # 3:1 in records


def test_mixture_spec_is_public_immutable_and_normalizes():
    from zephon.pipeline import MixtureSpec

    assert zephon.MixtureSpec is MixtureSpec
    weights = {"code": 1, "web": 3}
    spec = MixtureSpec(weights)
    weights["code"] = 100  # the spec kept its own copy
    assert spec.normalized == {"code": 0.25, "web": 0.75}
    assert spec == MixtureSpec({"web": 3, "code": 1}) and len({spec, MixtureSpec(weights)}) == 2
    with pytest.raises(TypeError):
        spec.weights["code"] = 2
    assert repr(spec) == "MixtureSpec({'code': 1, 'web': 3})"


@pytest.mark.parametrize(
    "weights,match",
    [
        ({}, "MixtureSpec needs at least one"),
        ([1, 2], "MixtureSpec weights must be a mapping {dataset name: weight}"),
        ({"a": 0}, "mixture weight for dataset 'a' must be a finite number > 0, got 0"),
        ({"a": float("nan")}, "mixture weight for dataset 'a' must be a finite number > 0"),
        ({"a": True}, "mixture weight for dataset 'a' must be a finite number > 0, got True"),
        ({"a": "1"}, "mixture weight for dataset 'a' must be a finite number > 0, got '1'"),
        ({1: 1.0}, r"MixtureSpec keys must be dataset names \(non-empty strings\), got 1"),
    ],
)
def test_invalid_mixture_specs_are_refused_where_they_are_written(weights, match):
    with pytest.raises(ConfigError, match=match) as info:
        zephon.MixtureSpec(weights)
    assert "\n" not in str(info.value)


def test_a_mixture_spec_must_name_exactly_the_datasets():
    with pytest.raises(
        ConfigError, match=r"mixture keys must be exactly the dataset names \['ds'\]"
    ):
        zephon.StaticMixtureWorkSource(make_dataset(), zephon.MixtureSpec({"other": 1}))
    with pytest.raises(ConfigError, match="mixture must be a MixtureSpec, a {dataset name"):
        zephon.StaticMixtureWorkSource(make_dataset(), 1.0)


# -- exhausted_policy -----------------------------------------------------------------------------


def passes_of(source, n: int) -> dict[int, list[tuple]]:
    """The first ``n`` chunks' rows, grouped by pass: ``{pass: [(shard, row), ...]}``."""
    out: dict[int, list[tuple]] = {}
    for k in range(n):
        c = source.chunk(k)
        rows = [(s, r) for s, start, stop in c.segments for r in range(start, stop)]
        out.setdefault(c.pass_index, []).extend(rows)
    return out


def test_repeat_is_endless_and_every_pass_covers_the_dataset_once():
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=4, per_shard=6), chunk_size=5, seed=1, exhausted_policy="repeat"
    )
    assert source.stop_after_passes is None
    by_pass = passes_of(source, 50)  # 24 records, 5 chunks a pass: 10 passes
    assert sorted(by_pass) == list(range(10))
    every_row = sorted((f"s{i:03d}", r) for i in range(4) for r in range(6))
    assert all(sorted(rows) == every_row for rows in by_pass.values())
    # reshuffled per pass, from the seed and the pass index: passes differ, runs agree
    assert len({tuple(rows) for rows in by_pass.values()}) > 1
    again = zephon.StaticMixtureWorkSource(
        make_dataset(shards=4, per_shard=6), chunk_size=5, seed=1, exhausted_policy="repeat"
    )
    assert passes_of(again, 50) == by_pass


def test_repeat_without_shuffling_repeats_the_same_order():
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=3, per_shard=4),
        chunk_size=5,
        shuffle_shards=False,
        exhausted_policy="repeat",
    )
    by_pass = passes_of(source, 30)
    assert len(by_pass) == 10 and len({tuple(rows) for rows in by_pass.values()}) == 1


def test_repeat_is_the_endless_curriculum_of_stop_after_passes_none():
    def source(**kwargs):
        return zephon.StaticMixtureWorkSource(make_dataset(), chunk_size=6, seed=3, **kwargs)

    repeat = source(exhausted_policy="repeat")
    endless = source(stop_after_passes=None)
    assert [repeat.chunk(k) for k in range(80)] == [endless.chunk(k) for k in range(80)]
    assert repeat.fingerprint() == endless.fingerprint()
    assert source(exhausted_policy="repeat", stop_after_passes=None).fingerprint() == (
        repeat.fingerprint()
    )


def _mixture_names(policy: str, n: int | None = None) -> list[str]:
    small = make_dataset("small", shards=1, per_shard=20)  # 2 chunks a pass
    large = make_dataset("large", shards=2, per_shard=50)  # 10 chunks a pass
    source = zephon.StaticMixtureWorkSource(
        [small, large],
        zephon.MixtureSpec({"small": 1, "large": 1}),
        chunk_size=10,
        exhausted_policy=policy,
    )
    got = chunks(source) if n is None else [source.chunk(k) for k in range(n)]
    return [c.dataset for c in got]


def test_under_leave_an_exhausted_dataset_leaves_and_the_others_go_on_alone():
    names = _mixture_names("leave")
    assert names == ["small", "large", "small", "large"] + ["large"] * 8


def test_under_stop_the_curriculum_ends_with_the_first_exhausted_dataset():
    assert _mixture_names("stop") == ["small", "large", "small"]  # large: 1 of 10 chunks


def test_under_repeat_the_weights_hold_forever():
    names = _mixture_names("repeat", 400)
    for end in range(2, 401, 2):  # 1:1 at every even prefix, pass after pass
        assert names[:end].count("small") == end // 2
    source = zephon.StaticMixtureWorkSource(
        [make_dataset("small", shards=1, per_shard=20), make_dataset("large", 2, 50)],
        {"small": 1, "large": 1},
        chunk_size=10,
        exhausted_policy="repeat",
    )
    last = source.chunk(399)  # the small dataset repeats five times as often as the large
    passes = {c.dataset: c.pass_index for c in (source.chunk(398), last)}
    assert passes == {"small": 99, "large": 19}


def test_the_default_policy_and_its_digest_are_unchanged():
    def source(**kwargs):
        return zephon.StaticMixtureWorkSource(make_dataset(), chunk_size=6, **kwargs)

    default = source()
    assert default.exhausted_policy == "leave" and default.stop_after_passes == 1
    assert source(exhausted_policy="leave", stop_after_passes=1).fingerprint() == (
        default.fingerprint()
    )
    assert source(exhausted_policy="stop").fingerprint() != default.fingerprint()
    assert "exhausted_policy='leave'" in repr(default)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"exhausted_policy": "forever"}, "exhausted_policy must be 'leave', 'stop' or 'repeat'"),
        ({"exhausted_policy": None}, "exhausted_policy must be 'leave', 'stop' or 'repeat'"),
        (
            {"exhausted_policy": "repeat", "stop_after_passes": 2},
            "exhausted_policy='repeat' repeats every dataset forever, so stop_after_passes must "
            "be left unset or None, got 2",
        ),
        (
            {"exhausted_policy": "stop", "stop_after_passes": 0},
            "stop_after_passes must be an integer >= 1 or None, got 0",
        ),
    ],
)
def test_invalid_exhausted_policies_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        zephon.StaticMixtureWorkSource(make_dataset(), **kwargs)
    assert "\n" not in str(info.value)


def test_lookups_deep_into_an_endless_mixture_match_planning_in_order(monkeypatch):
    from zephon.pipeline import work_source

    def plan():
        return zephon.StaticMixtureWorkSource(
            [make_dataset("a", shards=3, per_shard=7), make_dataset("b", shards=2, per_shard=5)],
            zephon.MixtureSpec({"a": 2, "b": 1}),
            chunk_size=3,
            seed=4,
            exhausted_policy="repeat",
        )

    reference = plan()
    expected = [reference.chunk(k) for k in range(3000)]
    monkeypatch.setattr(work_source, "_RECENT_CHUNKS", 8)
    source = plan()
    for k in [2500, 2501, 2499, 10, 2999, 40, 41, 39, 1500, 2998, 0, 777]:
        assert source.chunk(k) == expected[k]


def test_a_deep_lookup_plans_only_the_pass_it_lands_in():
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=4, per_shard=6), chunk_size=5, seed=1, exhausted_policy="repeat"
    )
    planned = []
    plan_pass = source._pass_chunks
    source._pass_chunks = lambda name, index: planned.append(index) or plan_pass(name, index)
    chunk = source.chunk(5 * 10**9 + 2)  # 5 chunks a pass: chunk 2 of pass 10**9
    assert (chunk.pass_index, planned) == (10**9, [10**9])
    fresh = zephon.StaticMixtureWorkSource(
        make_dataset(shards=4, per_shard=6), chunk_size=5, seed=1, exhausted_policy="repeat"
    )
    assert chunk.segments == fresh._pass_chunks("ds", 10**9)[2][0]
