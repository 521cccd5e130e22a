"""Resharding on load: DTensor model and AdamW state saved on 4 gloo ranks as ``Shard(0)`` loads on
2 ranks as ``Shard(0)``, ``Replicate()`` and ``Shard(1)``, on 4 ranks from a 2-rank save, and in
one process as plain tensors, through the checkpoint manager, through torch's ``dcp.save``/
``dcp.load`` with ``zephon.dcp.Writer``/``Reader`` (also a deduplicated save whose shards
are all chunks of the one before, docs/dedup.md), and a manager checkpoint through the plain
Reader; what each new rank gets of the manager's non-tensor state; verification of resharded
reads; and docs/manager.md's example, run as printed.

The four processes start once (``tests/zephon/dcp/reshard_worker.py`` goes through every
layout); the tests assert on what they reported.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import make_backend
from tests.ranks import launch, store_config
from tests.zephon.dcp.reshard_worker import DOCS, SAVED_LR, SECTION

pytestmark = pytest.mark.slow

#: 10 and 6 rows over 4 ranks: chunks of ceil(rows / 4), so uneven, and the last one empty
SAVED = {
    "0.weight": ([3, 3, 3, 1], [12]),
    "0.bias": ([3, 3, 3, 1], []),
    "1.weight": ([2, 2, 2, 0], [10]),
    "1.bias": ([2, 2, 2, 0], []),
}
LAYOUTS = {
    "shard0": {
        "0.weight": ["[Shard(dim=0)]", [5, 12]],
        "0.bias": ["[Shard(dim=0)]", [5]],
        "1.weight": ["[Shard(dim=0)]", [3, 10]],
        "1.bias": ["[Shard(dim=0)]", [3]],
    },
    "replicate": {
        "0.weight": ["[Replicate()]", [10, 12]],
        "0.bias": ["[Replicate()]", [10]],
        "1.weight": ["[Replicate()]", [6, 10]],
        "1.bias": ["[Replicate()]", [6]],
    },
    "shard1": {
        "0.weight": ["[Shard(dim=1)]", [10, 6]],
        "0.bias": ["[Shard(dim=0)]", [5]],
        "1.weight": ["[Shard(dim=1)]", [6, 5]],
        "1.bias": ["[Shard(dim=0)]", [3]],
    },
}
#: what every rank of a load on another world size gets: rank 0's state, no RNG, no rank_state
RANK_ZERO = {"counter": {"rank": 0, "seen": 100}, "extra": [0, [0.0, 0.0, 0.0]]}


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory) -> list[dict]:
    backend = make_backend("local", request, tmp_path_factory.mktemp("reshard"))
    return launch("tests.zephon.dcp.reshard_worker", 4, store_config(backend))


def loaded(record: dict) -> dict:
    assert "error" not in record, record["error"]
    return record["ok"]


def assert_equal_after_load(record: dict) -> None:
    assert "error" not in record, record["error"]
    assert len(record["differed_before"]) == 16  # 4 parameters, 3 optimizer tensors each
    assert record["differ_after"] == []


def test_the_saved_shards_are_uneven_and_one_is_empty(ranks):
    assert len(ranks) == 4
    for name, (rows, rest) in SAVED.items():
        shapes = [["[Shard(dim=0)]", [n, *rest]] for n in rows]
        assert [record["saved_layout"][name] for record in ranks] == shapes


@pytest.mark.parametrize("way", ["manager", "dcp", "dcp_dedup", "manager_via_reader"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_four_ranks_of_shard0_load_on_two_ranks_with_equal_full_tensors(ranks, layout, way):
    for record in ranks[:2]:
        load = record["two"][layout][way]
        assert_equal_after_load(load)
        assert load["layout"] == LAYOUTS[layout]
        # param_groups: JSON beside the tensors in a manager checkpoint (so not read through the
        # plain Reader), a DCP item of torch's own state dict
        assert load["lr"] == (0.5 if way == "manager_via_reader" else SAVED_LR)


def test_a_one_process_save_of_plain_tensors_loads_on_two_ranks_as_shard1(ranks):
    # the same state built without DTensors has the same values
    assert ranks[0]["plain_differs_from_sharded"] == []
    for record in ranks[:2]:
        load = record["two_from_one"]
        assert_equal_after_load(load)
        assert load["layout"] == LAYOUTS["shard1"]
        got = loaded(load)
        assert {k: got[k] for k in RANK_ZERO} == RANK_ZERO
        assert got["rank_state"] is None and got["rng_untouched"]


def test_a_two_rank_save_loads_on_four_ranks(ranks):
    for record in ranks:
        assert_equal_after_load(record["four"]["manager2"])
        assert record["four"]["manager2"]["layout"] == record["saved_layout"]


@pytest.mark.parametrize("way", ["manager", "manager2", "dcp", "dcp_dedup", "manager_via_reader"])
def test_one_process_loads_plain_tensors_with_equal_values(ranks, way):
    load = ranks[0]["one"][way]
    assert_equal_after_load(load)
    assert {kind for kind, _ in load["layout"].values()} == {"plain"}
    assert load["lr"] == (0.5 if way == "manager_via_reader" else SAVED_LR)


def test_a_damaged_chunk_fails_a_resharded_load_on_every_rank(ranks):
    damaged = ranks[0]["damaged"]
    assert damaged["shape"] == [3, 12]  # the whole chunk of rows 3..5 that rank 1 saved
    for record in ranks[:2]:
        error = record["two_damaged"]["verify_True"]["error"]
        assert error["type"] == "CorruptCheckpointError", error
        assert error["path"] == damaged["file"]
        assert "crc32c of model.0.weight" in error["message"]
        assert "the chunk at [3, 0]" in error["message"]
        # Rank 0 needs rows 3..4 of the chunk, not the damaged row 5, and found it itself: a
        # partial read of a chunk fetches and checks the whole chunk.
        assert error["notes"] == ["(raised on rank 0 of the DCP call on the load)"]


def test_without_verification_the_damaged_byte_loads_silently(ranks):
    for record in ranks[:2]:
        load = record["two_damaged"]["verify_False"]
        assert "error" not in load, load["error"]
        assert load["differ_after"] == ["model.0.weight"]


def test_on_four_to_two_ranks_every_rank_gets_rank_zeros_state_and_no_rng(ranks):
    for record in ranks[:2]:
        for layout in LAYOUTS:
            got = loaded(record["two"][layout]["manager"])
            assert {k: got[k] for k in RANK_ZERO} == RANK_ZERO
            assert got["rank_state"] is None
            assert got["rng_untouched"], "the RNG of another world size was restored"


def test_on_two_to_four_ranks_every_rank_gets_rank_zeros_state_and_no_rng(ranks):
    for record in ranks:
        got = loaded(record["four"]["manager2"])
        assert {k: got[k] for k in RANK_ZERO} == RANK_ZERO
        assert got["rank_state"] is None
        assert got["rng_untouched"]


def test_on_four_to_one_process_it_gets_rank_zeros_state_and_no_rng(ranks):
    for name in ("manager", "manager2"):
        got = loaded(ranks[0]["one"][name])
        assert {k: got[k] for k in RANK_ZERO} == RANK_ZERO
        assert got["rank_state"] is None
        assert got["rng_untouched"]


def test_on_the_same_world_size_every_rank_gets_its_own_state_and_rng(ranks):
    for rank, record in enumerate(ranks):
        got = loaded(record["four"]["manager"])
        assert got["counter"] == {"rank": rank, "seen": 100 + rank}
        assert got["extra"] == [rank, [float(rank)] * 3]
        assert got["rank_state"] == {"rank": rank, "name": f"rank-{rank}"}
        assert got["rng_draws"] == record["saved_rng_draws"]
        assert not got["rng_untouched"]
        assert record["four"]["manager"]["differ_after"] == []


def test_the_manager_docs_example_prints_what_the_page_says(ranks):
    with open(DOCS) as handle:
        section = handle.read().split(SECTION, 1)[1]
    after_code = section.split("```python\n", 1)[1].split("```\n", 1)[1]
    printed = re.findall(r"\n```\n(.*?)```", after_code, re.S)[:2]
    assert ranks[0]["docs_save"] == printed[0]
    assert ranks[0]["docs_load"] == printed[1]
    assert all(r["docs_save"] == "" for r in ranks[1:]), "only rank 0 prints"
