"""Elastic resumption: a run on 4 data-parallel groups resumes on 2 with the same global steps.

All ranks live in this one process so the example runs anywhere; in a real job each pipeline is
built on its own rank and ``aggregate_dir`` is shared storage such as ``s3://bucket/agg``.

Run: ``python examples/pipeline_elastic.py``
"""

from __future__ import annotations

import tempfile

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
        for p in four[1:]:  # every rank checkpoints after the same step ...
            assert p.checkpoint() is None
        state = four[0].checkpoint()  # ... and rank 0 returns the merged state to save

        two = [build(2, r, agg) for r in range(2)]
        for p in two:
            p.restore(state)  # same canonical_replicas, new dp_degree: lanes are reassigned
        got += steps(two, 6)

    assert got == reference
    print("resumed on 2 groups: all 10 global steps hold exactly the records of the 4-group run")


if __name__ == "__main__":
    main()
