"""One rank of the torch.distributed (gloo) aggregation tests, run as a separate process.

``python -m tests.zephon.pipeline.agg_torch_worker RANK 4 PORT``, started by ``tests.ranks.launch``
with the configuration keys workdir and port2 (the second phase's rendezvous port); ranks 0-3
run the first phase, ranks 0 and 1 then the second in a new process group. Prints one line
``RESULT <json>`` of what the rank saw, by phase.

- ``first`` (4 ranks, 4 data-parallel groups): the configuration errors a wrong topology
  gives; a pipeline on each of two 2-rank groups passed as ``aggregate_group``; three pipelines
  in lockstep, over ``aggregate_store="torch://"``, over the default transport (nothing given)
  and over ``aggregate_dir``, checkpointed after 2 and 5 steps; the next steps of the running
  pipeline and of one restored from the state; then rank 3 skips a checkpoint
  (``aggregate_timeout_s=2``) and calls it only after the others gave up.
- ``resume`` (2 ranks, 2 groups): restores the first phase's state from
  ``<workdir>/state.json`` and trains on; checkpoints once more.
- ``address`` (4 ranks, no process group at all): two pipelines in lockstep over
  ``aggregate_store="torch://127.0.0.1:<port3>"`` (nobody serves it: rank 0 hosts) and over
  ``torch://127.0.0.1:<port4>`` (the test serves it), checkpointed as in ``first``; then rank 3
  skips a checkpoint and calls it only after the others gave up (they leave a file each).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
import warnings

import zephon
from tests.ranks import rank_config, report
from tests.zephon.pipeline.util import make_dataset
from zephon.errors import ConfigError
from zephon.pipeline import AggregationTimeoutError

LANES = 4
MICROBATCH = 4
GLOBAL_MICROBATCHES = 4  # per optimizer step, over all groups: one per lane
CHECKPOINTS = (2, 5)  # optimizer steps of the first phase after which every rank checkpoints
RESUMED_STEPS = 4


def build(rank: int, world_size: int, **options) -> zephon.Pipeline:
    source = zephon.StaticMixtureWorkSource(
        make_dataset(shards=4, per_shard=50), chunk_size=9, seed=8
    )
    options = {
        "world_size": world_size,
        "global_rank": rank,
        "dp_degree": world_size,
        "dp_group_id": rank,
        "canonical_replicas": LANES,
        **options,
    }
    return zephon.Pipeline(source).shuffle(5).batch(MICROBATCH).prefetch(2).options(**options)


def text(state: dict) -> str:
    return json.dumps(state, separators=(",", ":"))


def configuration_errors(rank: int, world_size: int) -> dict[str, str]:
    """What a wrong topology or group gives, with torch.distributed initialised."""
    cases = {
        "world_size": lambda: build(0, 2, aggregate_store="torch://"),
        "global_rank": lambda: build((rank + 1) % world_size, world_size),
        "group": lambda: build(rank, world_size, aggregate_group="not a group"),
    }
    errors = {}
    for name, make in cases.items():
        try:
            iter(make())
        except ConfigError as exc:
            errors[name] = str(exc)
    return errors


def first(rank: int, world_size: int, workdir: str) -> dict:
    import torch.distributed as dist

    errors = configuration_errors(rank, world_size)
    # two pipelines of two ranks each, on groups of their own, with the same run_id
    pairs = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    pair = build(rank % 2, 2, aggregate_group=pairs[rank // 2], run_id="pair")
    pair_batches = iter(pair)
    for _ in range(2):
        next(pair_batches)
    pair_state = text(pair.checkpoint())
    pair.close()
    per_group = GLOBAL_MICROBATCHES // world_size
    pipelines = {
        "torch": build(rank, world_size, aggregate_store="torch://", run_id="first"),
        "default": build(rank, world_size),
        "storage": build(
            rank, world_size, aggregate_dir=os.path.join(workdir, "agg"), run_id="first"
        ),
    }
    iterators = {name: iter(p) for name, p in pipelines.items()}
    keys, states, done = [], {name: [] for name in pipelines}, 0
    for target in CHECKPOINTS:
        for _ in range(per_group * (target - done)):
            batches = {name: next(it) for name, it in iterators.items()}
            assert len({str(b.keys) for b in batches.values()}) == 1  # lockstep, same data
            keys.append(batches["torch"].keys)
        done = target
        for name, p in pipelines.items():
            states[name].append(text(p.checkpoint()))
    state = json.loads(states["torch"][-1])
    if rank == 0:
        with open(os.path.join(workdir, "state.json"), "w") as handle:
            json.dump(state, handle)

    # the running pipeline and one restored from this rank's state: the same next batches and
    # the same next checkpoint
    after = [next(iterators["torch"]).keys for _ in range(per_group * 2)]
    restored = build(rank, world_size, run_id="restored")
    restored.restore(state)
    resumed = iter(restored)
    again = [next(resumed).keys for _ in range(per_group * 2)]
    next_states = [text(pipelines["torch"].checkpoint()), text(restored.checkpoint())]
    for p in [*pipelines.values(), restored]:
        p.close()

    # rank 3 does not come to this checkpoint; after the others gave up it comes too late
    late = build(rank, world_size, run_id="late", aggregate_timeout_s=2)
    timeout: dict = {}
    dist.barrier()  # ranks 0-2 come together, so only rank 3 can be missing after 2 s
    if rank != world_size - 1:
        started = time.monotonic()
        try:
            late.checkpoint()
        except AggregationTimeoutError as exc:
            timeout = {"missing": exc.missing_ranks, "message": str(exc)}
        timeout["waited_s"] = time.monotonic() - started
    dist.barrier()
    if rank == world_size - 1:
        try:
            late.checkpoint()
        except AggregationTimeoutError as exc:
            timeout = {"missing": exc.missing_ranks, "message": str(exc)}
    dist.barrier()
    return {
        "errors": errors,
        "pair_state": pair_state,
        "keys": keys,
        "states": states,
        "after": after,
        "again": again,
        "next_states": next_states,
        "timeout": timeout,
    }


def resume(rank: int, world_size: int, workdir: str) -> dict:
    with open(os.path.join(workdir, "state.json")) as handle:
        state = json.load(handle)
    p = build(rank, world_size, aggregate_store="torch://")
    p.restore(state)
    it = iter(p)
    per_group = GLOBAL_MICROBATCHES // world_size
    keys = [next(it).keys for _ in range(per_group * RESUMED_STEPS)]
    final = text(p.checkpoint())
    p.close()
    return {"keys": keys, "final": final}


def address(rank: int, world_size: int, workdir: str, ports: tuple[int, int]) -> dict:
    hosted, served = (f"torch://127.0.0.1:{port}" for port in ports)
    pipelines = {
        "hosted": build(rank, world_size, aggregate_store=hosted, run_id="first"),
        "served": build(rank, world_size, aggregate_store=served, run_id="first"),
    }
    iterators = {name: iter(p) for name, p in pipelines.items()}
    states, done = {name: [] for name in pipelines}, 0
    for target in CHECKPOINTS:
        for _ in range(GLOBAL_MICROBATCHES // world_size * (target - done)):
            batches = {name: next(it) for name, it in iterators.items()}
            assert len({str(b.keys) for b in batches.values()}) == 1  # lockstep, same data
        done = target
        for name, p in pipelines.items():
            states[name].append(text(p.checkpoint()))
    for p in pipelines.values():
        p.close()
    # the last checkpoint brought every rank together: only rank 3 can be missing after 2 s
    late = build(rank, world_size, aggregate_store=hosted, run_id="late", aggregate_timeout_s=2)
    timeout: dict = {}
    if rank == world_size - 1:
        gave_up = [os.path.join(workdir, f"gave-up-{r}") for r in range(world_size - 1)]
        deadline = time.monotonic() + 120
        while not all(os.path.exists(path) for path in gave_up):
            assert time.monotonic() < deadline, "the other ranks never gave up"
            time.sleep(0.05)
    try:
        late.checkpoint()
    except AggregationTimeoutError as exc:
        timeout = {"missing": exc.missing_ranks, "message": str(exc)}
    if rank != world_size - 1:
        open(os.path.join(workdir, f"gave-up-{rank}"), "w").close()
        time.sleep(5)  # rank 0 hosts the store: keep it up until rank 3 has come
    return {"states": states, "timeout": timeout}


def main(rank: int, world: int, first_port: int, config: dict) -> None:
    import torch.distributed as dist  # here: the test imports build() before skipping on torch

    warnings.simplefilter("ignore")
    workdir, out = config["workdir"], {"rank": rank}
    # One process per rank for both phases: starting torch twice would double the test's time.
    for phase, world_size, port in (("first", world, first_port), ("resume", 2, config["port2"])):
        if rank >= world_size:
            break
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=dt.timedelta(seconds=180),  # ranks start far apart on a loaded machine
        )
        try:
            out[phase] = (first if phase == "first" else resume)(rank, world_size, workdir)
        finally:
            dist.destroy_process_group()
    assert not dist.is_initialized()
    out["address"] = address(rank, world, workdir, (config["port3"], config["port4"]))
    report(out)


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:4]), rank_config())
