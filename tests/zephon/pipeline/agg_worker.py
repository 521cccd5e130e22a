"""One rank of a multi-process aggregation test, run as a separate Python process.

``python -m tests.zephon.pipeline.agg_worker RANK WORLD PORT``, started by ``tests.ranks.launch``
(no process group: PORT is not used) with the configuration keys dp_degree, url,
storage_options, run_id, checkpoints (batch counts after which to call checkpoint()), timeout.
Prints one line ``RESULT <json>``: the rank, the keys it delivered, what checkpoint() returned,
and the keys of the next two batches both from the running pipeline and from a new one restored
from the last state (they must be equal on every rank).
"""

from __future__ import annotations

import sys
import threading

import zephon
from tests.ranks import rank_config, report
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


def checkpoint_together(pipelines: list[zephon.Pipeline]) -> list:
    """``checkpoint()`` on every pipeline at once, one thread each, as separate ranks would
    call it (a rank waits for the others, so calling them in turn would stall): what each
    returned or raised, by rank."""
    results: list = [None] * len(pipelines)

    def run(i: int) -> None:
        try:
            results[i] = pipelines[i].checkpoint()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pipelines))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def checkpoint_all(pipelines: list[zephon.Pipeline]) -> dict:
    """The state every rank returned (they must be equal); the first error raised, if any."""
    results = checkpoint_together(pipelines)
    for result in results:
        if isinstance(result, Exception):
            raise result
    assert all(result == results[0] for result in results), results
    return results[0]


def states_at(pipelines: list[zephon.Pipeline], checkpoints: list[int]) -> list[dict]:
    """Ranks in this one process: every pipeline advanced to each count of batches in
    ``checkpoints`` (ascending), the merged state ``checkpoint_all`` gives there; the pipelines
    are closed afterwards."""
    iterators = [iter(p) for p in pipelines]
    states, done = [], 0
    for target in checkpoints:
        for it in iterators:
            for _ in range(target - done):
                next(it)
        done = target
        states.append(checkpoint_all(pipelines))
    for p in pipelines:
        p.close()
    return states


def main(rank: int, world: int, config: dict) -> None:
    args = {**config, "rank": rank, "world_size": world}
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
    after = [k for _ in range(2) for k in next(it).keys]
    p.close()
    q = build(
        *(args[k] for k in ("rank", "world_size", "dp_degree", "url", "storage_options")), "q", 1
    )
    q.restore(states[-1])
    resumed = iter(q)
    restored = [list(k) for _ in range(2) for k in next(resumed).keys]
    q.close()
    report(
        {
            "rank": rank,
            "keys": delivered,
            "states": states,
            "after": [list(k) for k in after],
            "restored": restored,
        }
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), rank_config())
