"""One rank of a multi-process aggregation test, run as a separate Python process.

``python -m tests.zephon.pipeline.agg_worker '<json>'`` with keys rank, world_size, dp_degree,
url, storage_options, run_id, checkpoints (batch counts after which to call checkpoint()),
timeout. Prints one JSON line: the rank, the keys it delivered, and what checkpoint() returned.
"""

from __future__ import annotations

import json
import sys

import zephon
from tests.zephon.pipeline.util import make_dataset

LANES = 4


def build(
    rank: int,
    world_size: int,
    dp_degree: int,
    url: str,
    storage_options: dict,
    run_id: str,
    timeout: float,
) -> zephon.Pipeline:
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=4, per_shard=50), chunk_size=9, seed=8
    )
    group = rank * dp_degree // world_size  # consecutive ranks share a group (TP replicas)
    return (
        zephon.Pipeline(source)
        .shuffle(5)
        .batch(4)
        .prefetch(3)
        .options(
            world_size=world_size,
            global_rank=rank,
            dp_degree=dp_degree,
            dp_group_id=group,
            canonical_replicas=LANES,
            aggregate_dir=url,
            storage_options=storage_options or None,
            run_id=run_id,
            aggregate_timeout_s=timeout,
        )
    )


def main(args: dict) -> None:
    p = build(
        args["rank"],
        args["world_size"],
        args["dp_degree"],
        args["url"],
        args["storage_options"],
        args["run_id"],
        args["timeout"],
    )
    it = iter(p)
    delivered, states, done = [], [], 0
    for target in args["checkpoints"]:
        while done < target:
            delivered.extend(next(it).keys)
            done += 1
        states.append(p.checkpoint())
    p.close()
    print(json.dumps({"rank": args["rank"], "keys": delivered, "states": states}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
