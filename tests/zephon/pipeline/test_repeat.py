"""Endless curricula (``exhausted_policy="repeat"``) through a pipeline: checkpoints taken on
every side of a repeat boundary restore exactly, for one dataset and for a mixture."""

from __future__ import annotations

import json

import pytest

import zephon
from tests.zephon.pipeline.util import make_dataset

BATCHES = 60  # about nine passes over the 21-record dataset


def annotate(record: dict) -> dict:
    return {**record, "k": record["n"] * 3}


def build(policy: str = "repeat", mixture: bool = False, pack: bool = False) -> zephon.Pipeline:
    datasets = [make_dataset("one", shards=3, per_shard=7)]
    if mixture:
        datasets.append(make_dataset("two", shards=2, per_shard=11))
    source = zephon.StaticMixtureWorkSource(
        datasets,
        zephon.MixtureSpec({"one": 2, "two": 1}) if mixture else None,
        chunk_size=4,
        seed=11,
        exhausted_policy=policy,
    )
    p = zephon.Pipeline(source).map_transform(annotate).shuffle(5, seed=2)
    if pack:
        p.map_transform(lambda r: [r["n"] % 7 + 1] * (r["n"] % 4 + 1))
        p.pack_sequences(6, max_open_bins=2)
    return p.batch(3).options(canonical_replicas=2, flush_every_k_chunks=2)


def describe(batch) -> tuple:
    return batch.lane, json.dumps(batch.payloads, sort_keys=True), tuple(batch.keys)


def take(pipeline: zephon.Pipeline, n: int) -> list[tuple]:
    """The next ``n`` batches; only they are delivered (and so counted by checkpoint())."""
    it = iter(pipeline)
    out = []
    while len(out) < n and (batch := next(it, None)) is not None:
        out.append(describe(batch))
    return out


@pytest.mark.parametrize("mixture,pack", [(False, False), (True, False), (True, True)])
def test_a_checkpoint_at_any_batch_across_repeats_restores_exactly(mixture, pack):
    reference = take(build(mixture=mixture, pack=pack), BATCHES)
    assert len(reference) == BATCHES
    source = build(mixture=mixture, pack=pack)._source
    passes = {source.chunk(chunk).pass_index for _, _, keys in reference for _, chunk, _ in keys}
    assert len(passes) >= 5  # the sweep below crosses several repeat boundaries

    # some flush windows hold the end of one pass and the start of the next, so some cuts
    # land inside a window that spans a repeat boundary
    def spans(lane: int, window: int) -> bool:
        got = [source.lane_chunk(lane, j, 2) for j in (2 * window, 2 * window + 1)]
        return got[0].dataset == got[1].dataset and got[0].pass_index != got[1].pass_index

    assert any(spans(lane, w) for lane in (0, 1) for w in range(10))

    for cut in range(BATCHES + 1):
        first = build(mixture=mixture, pack=pack)
        seen = take(first, cut)
        state = json.loads(json.dumps(first.checkpoint()))
        first.close()
        resumed = build(mixture=mixture, pack=pack)
        resumed.restore(state)
        seen += take(resumed, BATCHES - cut)
        resumed.close()
        assert seen == reference, f"restore after {cut} batches"


def test_restoring_twice_far_into_an_endless_run_continues_it():
    reference = take(build(mixture=True), 400)
    p = build(mixture=True)
    seen = take(p, 150)
    q = build(mixture=True)
    q.restore(p.checkpoint())
    seen += take(q, 150)
    r = build(mixture=True)
    r.restore(q.checkpoint())
    seen += take(r, 100)
    assert seen == reference


def test_a_repeat_state_is_refused_by_a_one_pass_pipeline_naming_the_work_source():
    state = build("repeat").checkpoint()
    with pytest.raises(zephon.PipelineStateError) as info:
        build("leave").restore(state)
    assert info.value.field == "work_source"


@pytest.mark.parametrize("policy", ["leave", "stop"])
def test_finite_policies_end_and_restore_exactly(policy):
    reference = [describe(b) for b in build(policy, mixture=True)]
    for cut in range(0, len(reference) + 1, 2):
        first = build(policy, mixture=True)
        seen = take(first, cut)
        resumed = build(policy, mixture=True)
        resumed.restore(first.checkpoint())
        seen += [describe(b) for b in resumed]
        assert seen == reference


def test_stop_ends_before_leave_and_leave_delivers_each_record_once():
    leave = [r.sample_id for b in build("leave", mixture=True) for r in b]
    stop = [r.sample_id for b in build("stop", mixture=True) for r in b]
    assert len(set(leave)) == len(leave) and len(stop) < len(leave)
