"""Elastic resumption: a run on 4 data-parallel groups resumes on 2 with the same global steps.

All ranks live in this one process so the example runs anywhere, assembling checkpoints through
a temporary ``aggregate_dir``; in a real job each pipeline is built on its own rank, and with
torch.distributed initialised no ``aggregate_dir`` is needed (``aggregate_store="torch://"``).

Run: ``python examples/pipeline_elastic.py``
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor

import zephon

LANES = 8  # canonical_replicas: fixed for the life of the run
MICROBATCH = 4
GLOBAL_BATCH = 64  # records per optimizer step, on any topology


def build(groups: int, rank: int, aggregate_dir: str) -> zephon.Pipeline:
    dataset = zephon.Dataset.from_dict(
        "demo",
        {
            f"s{s}": zephon.InMemoryShard([{"id": s * 1000 + i} for i in range(250)])
            for s in range(8)
        },
    )
    source = zephon.StaticMixtureWorkSource(dataset, chunk_size=50, seed=1)
    return (
        zephon.Pipeline(source)
        .shuffle(32)
        .batch(MICROBATCH)
        .options(
            world_size=groups,
            global_rank=rank,
            dp_degree=groups,
            dp_group_id=rank,
            canonical_replicas=LANES,
            aggregate_dir=aggregate_dir,
            run_id="elastic-demo",
        )
    )


def steps(pipelines: list[zephon.Pipeline], count: int) -> list[list[int]]:
    """Records of each optimizer step, summed over all data-parallel groups."""
    groups = len(pipelines)
    zephon.check_elastic_config(LANES, groups, MICROBATCH, global_batch_size=GLOBAL_BATCH)
    per_group = GLOBAL_BATCH // (groups * MICROBATCH)
    iterators = [iter(p) for p in pipelines]
    return [
        sorted(p["id"] for it in iterators for _ in range(per_group) for p in next(it).payloads)
        for _ in range(count)
    ]


def main() -> None:
    with tempfile.TemporaryDirectory() as agg:
        reference = steps([build(4, r, agg) for r in range(4)], 10)

        four = [build(4, r, agg) for r in range(4)]
        got = steps(four, 4)
        # Every rank checkpoints after the same step and gets the same merged state to save.
        # Ranks wait for each other there, so in one process each calls from its own thread.
        with ThreadPoolExecutor(len(four)) as pool:
            states = list(pool.map(zephon.Pipeline.checkpoint, four))
        assert all(s == states[0] for s in states)
        state = states[0]

        two = [build(2, r, agg) for r in range(2)]
        for p in two:
            p.restore(state)  # same canonical_replicas, new dp_degree: lanes are reassigned
        got += steps(two, 6)

    assert got == reference
    print("resumed on 2 groups: all 10 global steps hold exactly the records of the 4-group run")


if __name__ == "__main__":
    main()
