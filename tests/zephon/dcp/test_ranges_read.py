"""``zephon.dcp.api.ranges_read``: what a load will read, as its planner chooses it, which the
memory tier's resume fetches from peers instead of whole files; and ``merge_spans``, which
joins those ranges per file."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from zephon import dcp as zd
from zephon.dcp.api import ranges_read
from zephon.destinations.memory.assembly import merge_spans


def _saved(local_backend, state):
    """``state`` saved as step 1 of run ``r`` in two shard files; the open store."""
    store = local_backend.open_store()
    zd.save(state, zd.ZephonStorageWriter(store.run("r").begin(1), thread_count=2))
    return store


def test_a_load_of_some_keys_reads_their_items_and_nothing_else(local_backend, parallel_shards):
    state = {"a": torch.randn(64, 32), "b": torch.randn(128, 16), "c": torch.arange(5)}
    store = _saved(local_backend, state)
    try:
        reader = zd.ZephonStorageReader(store, "r", 1)
        every = ranges_read({k: torch.zeros_like(v) for k, v in state.items()}, reader)
        only_a = ranges_read(
            {"a": torch.zeros(64, 32)},
            zd.ZephonStorageReader(store, "r", 1),
            allow_partial_load=True,
        )
        assert sum(len(spans) for spans in every.values()) == 3 and len(every) == 2
        ((name, [(offset, length)]),) = only_a.items()
        assert length == state["a"].numel() * 4 and (offset, length) in every[name]
        # the range holds the tensor's own bytes, as saved
        held = store.run("r").reader(1).read_range(name, offset, offset + length)
        assert bytes(held) == state["a"].numpy().tobytes()
        # and the load that follows reads exactly that
        target = {"a": torch.zeros(64, 32)}
        zd.load(target, zd.ZephonStorageReader(store, "r", 1), allow_partial_load=True)
        assert torch.equal(target["a"], state["a"])
    finally:
        store.close()


spans = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=12)


@given(spans, st.integers(0, 16))
def test_merged_spans_cover_the_same_bytes_and_keep_apart_only_what_lies_beyond_the_gap(
    given_spans, gap
):
    merged = merge_spans(given_spans, gap)
    covered = {b for offset, length in given_spans for b in range(offset, offset + length)}
    joined = {b for offset, length in merged for b in range(offset, offset + length)}
    assert covered <= joined  # nothing asked for is left out
    assert all(b in covered or _within_gap(b, covered, gap) for b in joined)  # filled gaps only
    ends = [offset + length for offset, length in merged]
    assert all(merged[i + 1][0] > ends[i] + gap for i in range(len(merged) - 1))


def _within_gap(byte: int, covered: set[int], gap: int) -> bool:
    return any(b < byte for b in covered) and any(byte < b <= byte + gap for b in covered)
