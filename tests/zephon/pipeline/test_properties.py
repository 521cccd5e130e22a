"""Property tests: for random operator chains and random checkpoint points, the records before a
checkpoint plus the records after restoring it equal an uninterrupted run, for finite curricula
and for endless ones (``exhausted_policy="repeat"``), whose checkpoints fall anywhere across
repeat boundaries."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zephon


def _key(payload) -> int:
    return payload["n"] if "n" in payload else sum(payload["tokens"]) + len(payload["tokens"])


def drop_some(payload):
    """Deterministic, content-based: drops about one record in five."""
    return None if _key(payload) % 5 == 1 else payload


def annotate(payload):
    return {**payload, "k": _key(payload) * 3}


def keep_none(payload):
    """A map whose ``None`` results are kept (drop_none=False) as records."""
    return None if _key(payload) % 11 == 0 else payload


def tolerant(payload):
    return payload if payload is not None else {"n": -1, "tokens": [0]}


op_strategy = st.one_of(
    st.tuples(st.just("drop"), st.none()),
    st.tuples(st.just("annotate"), st.none()),
    st.tuples(st.just("keep_none"), st.none()),
    st.tuples(st.just("shuffle"), st.tuples(st.integers(1, 9), st.integers(0, 3))),
    st.tuples(st.just("pack"), st.tuples(st.integers(4, 12), st.integers(1, 4))),
)


@st.composite
def configs(draw):
    n_datasets = draw(st.integers(1, 2))
    datasets = []
    for d in range(n_datasets):
        lengths = draw(st.lists(st.integers(0, 30), min_size=1, max_size=4))
        shards = {
            f"s{i}": zephon.InMemoryShard(
                [
                    {"n": d * 10_000 + i * 100 + j, "tokens": [j % 7 + 1] * (j % 5 + 1)}
                    for j in range(length)
                ]
            )
            for i, length in enumerate(lengths)
        }
        datasets.append((f"d{d}", shards))
    ops = draw(st.lists(op_strategy, max_size=4))
    reordering = any(kind in {"shuffle", "pack"} for kind, _ in ops)
    flush = draw(st.one_of(st.none(), st.integers(1 if reordering else 0, 3)))
    return {
        "datasets": datasets,
        "weights": draw(
            st.one_of(
                st.none(), st.lists(st.integers(1, 4), min_size=n_datasets, max_size=n_datasets)
            )
        ),
        "passes": draw(st.integers(1, 2)),
        "policy": draw(st.sampled_from(["leave", "stop"])),
        "chunk_size": draw(st.integers(1, 12)),
        "lanes": draw(st.integers(1, 4)),
        "batch": draw(st.integers(1, 6)),
        "drop_last": draw(st.booleans()),
        "flush": flush,
        "ops": ops,
    }


def build(cfg, prefetch=None):
    datasets = [zephon.Dataset.from_dict(name, shards) for name, shards in cfg["datasets"]]
    passes = {} if cfg["policy"] == "repeat" else {"stop_after_passes": cfg["passes"]}
    source = zephon.StaticMixtureWorkSource(
        datasets,
        cfg["weights"],
        chunk_size=cfg["chunk_size"],
        seed=7,
        exhausted_policy=cfg["policy"],
        **passes,
    )
    p = zephon.Pipeline(source)
    after_keep_none = False
    for kind, arg in cfg["ops"]:
        if after_keep_none:  # later operators must cope with the kept Nones
            p.map_transform(tolerant)
            after_keep_none = False
        if kind == "drop":
            p.map_transform(drop_some)
        elif kind == "annotate":
            p.map_transform(annotate)
        elif kind == "keep_none":
            p.map_transform(keep_none, drop_none=False)
            after_keep_none = True
        elif kind == "shuffle":
            p.shuffle(arg[0], seed=arg[1])
        else:
            p.pack_sequences(arg[0], max_open_bins=arg[1])
    p.batch(cfg["batch"], drop_last=cfg["drop_last"])
    if prefetch:
        p.prefetch(*prefetch)
    return p.options(canonical_replicas=cfg["lanes"], flush_every_k_chunks=cfg["flush"])


def describe(batch) -> tuple:
    return batch.lane, json.dumps(batch.payloads, sort_keys=True), tuple(batch.keys)


def take(iterator, n: int) -> list[tuple]:
    out = []
    for _ in range(n):
        batch = next(iterator, None)
        if batch is None:
            break
        out.append(describe(batch))
    return out


prefetch_strategy = st.one_of(st.none(), st.tuples(st.integers(1, 4), st.integers(1, 3)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), data=st.data())
def test_records_before_plus_after_restore_equal_an_uninterrupted_run(cfg, data):
    reference = [describe(b) for b in build(cfg)]
    total = len(reference)
    # points may be 0 (before the first batch) and total (the end of the pass)
    first = data.draw(st.integers(0, total), label="first checkpoint")
    second = data.draw(st.integers(0, total - first), label="batches after the first restore")

    p = build(cfg, data.draw(prefetch_strategy, label="prefetch 1"))
    it = iter(p)
    seen = take(it, first)
    state = json.loads(json.dumps(p.checkpoint()))
    p.close()

    q = build(cfg, data.draw(prefetch_strategy, label="prefetch 2"))
    q.restore(state)
    assert q.checkpoint() == state  # checkpoint right after a restore
    it = iter(q)
    seen += take(it, second)
    state = q.checkpoint()
    q.close()

    r = build(cfg)  # resume a second time
    r.restore(state)
    seen += [describe(b) for b in r]
    assert seen == reference


@settings(max_examples=40, deadline=None)
@given(cfg=configs())
def test_a_full_pass_delivers_every_record_exactly_once(cfg):
    cfg = {
        **cfg,
        "ops": [op for op in cfg["ops"] if op[0] in {"shuffle", "annotate"}],
        "drop_last": False,
        "policy": "leave",
    }
    if cfg["flush"] == 0 and cfg["ops"]:
        cfg["flush"] = 1
    records = [r for b in build(cfg) for r in b]
    expected = sorted(
        f"{name}/{shard_id}/{row}"
        for name, shards in cfg["datasets"]
        for shard_id, shard in shards.items()
        for row in range(len(shard))
    )
    assert sorted(r.sample_id for r in records) == sorted(expected * cfg["passes"])
    assert len({(r.lane, r.chunk, r.offset) for r in records}) == len(records)


def _stops_yielding(ops) -> bool:
    """Whether a map drops records after a pack: it could drop every bin of an endless run,
    which would then never yield a batch (before a pack, every shard's row 0 survives)."""
    packed = False
    for kind, _ in ops:
        packed = packed or kind == "pack"
        if packed and kind == "drop":
            return True
    return False


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), data=st.data())
def test_an_endless_curriculum_restores_exactly_across_repeats(cfg, data):
    cfg = {**cfg, "policy": "repeat"}
    if _stops_yielding(cfg["ops"]):
        cfg["ops"] = [op for op in cfg["ops"] if op[0] != "drop"]
    n = data.draw(st.integers(0, 40), label="batches of the run")
    p = build(cfg)
    reference = take(iter(p), n)  # up to 40 passes over the smallest datasets drawn
    p.close()
    first = data.draw(st.integers(0, len(reference)), label="first checkpoint")
    second = data.draw(st.integers(0, len(reference) - first), label="batches after restore")

    p = build(cfg, data.draw(prefetch_strategy, label="prefetch 1"))
    seen = take(iter(p), first)
    state = json.loads(json.dumps(p.checkpoint()))
    p.close()

    q = build(cfg, data.draw(prefetch_strategy, label="prefetch 2"))
    q.restore(state)
    assert q.checkpoint() == state
    seen += take(iter(q), second)
    state = q.checkpoint()
    q.close()

    r = build(cfg)
    r.restore(state)
    seen += take(iter(r), len(reference) - len(seen))
    r.close()
    assert seen == reference
