"""The memory tier: how long a save blocks training, and the time from a restart to the first
training step, from the job's own memory, from a peer's copy, and from save_dir on S3.

    python benchmarks/memory_tier.py [--delay-ms 30] [--mib 256] [--tensors 50] [--repeats 3]
                                     [--nodes 2] [--per-node 2] [--memory-root /dev/shm]

moto's S3 server on 127.0.0.1 behind ``latency_proxy.LatencyProxy`` adding ``--delay-ms`` to
every request (a far-away object store), a SQLite catalog, ``--nodes`` simulated nodes of
``--per-node`` gloo ranks each (the ranks of a node share a memory directory under
``--memory-root``; nodes share nothing else), ``--mib`` MiB per rank in ``--tensors`` fp32
parameters (``Shard(0)`` DTensors). In one run:

(a) blocked: ``CheckpointManager.save`` with ``memory_tier`` (returns once the save is
    committed in host memory; the peer copies and the upload go on in the background) vs the
    same manager straight to S3, each after the job's start (``load_latest``, which registers
    its attempt), as in a job that saves many times. The slowest rank's call. Goal: <= 0.05x.
(b) restart to the first step: a new ``CheckpointManager`` and ``load_latest``, then one
    training step, on every rank (the slowest), as a restarted job does once its processes
    are up (starting Python and torch is the same whatever the tier, and left out):
    - from its own memory (every node alive);
    - from the peer copy (the last node's memory deleted first: a replacement node);
    - from save_dir on S3 (a manager without the memory tier), the baseline.
    Alternating, ``--repeats`` each, a new save before each round. Goals: >= 10x faster from
    own memory, >= 5x from the peer copy.

Ratios come from the same run (the machine is shared); the load average is printed with them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

from _common import join_group, parse_or_serve, run_ranks, servers, table, timed
from latency_proxy import LatencyProxy
from local_tier import build_model, options_for

BUCKET = "memory-tier"


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import torch
    import torch.distributed as dist

    from zephon import CheckpointingConfig, CheckpointManager

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    join_group(rank, world, port, timeout=3600)
    node = rank // config["per_node"]
    memory_dir = os.path.join(config["memory_root"], f"node{node}")
    leads_node = rank % config["per_node"] == 0
    last_node = node == world // config["per_node"] - 1

    def slowest(seconds: float) -> float:
        every = [0.0] * world
        dist.all_gather_object(every, seconds)
        return max(every)

    model = build_model(config["mib"], config["tensors"], world)
    state = {"model": model}

    def train_step() -> None:
        with torch.no_grad():
            for p in model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)

    def manager(memory: bool) -> CheckpointManager:
        extra = {"memory_tier": True, "memory_dir": memory_dir} if memory else {}
        checkpointing = CheckpointingConfig(
            save_dir=f"s3://{BUCKET}/ckpt",
            storage_options=options_for(config["endpoint"]),
            catalog_url=config["catalog_url"],
            num_to_keep=1,
            **extra,
        )
        return CheckpointManager(checkpointing, run_name=config["run"], total_steps=10_000)

    def restart(memory: bool, tag: str = "") -> float:
        """A restarted job: its manager, its resume, its first step."""
        import cProfile
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        began = time.perf_counter()
        job = manager(memory)
        t1 = time.perf_counter()
        resume = job.load_latest(state)
        t2 = time.perf_counter()
        train_step()
        seconds = time.perf_counter() - began
        prof.disable()
        prof.dump_stats(f"/tmp/prof/{tag}-r{rank}-{time.time():.0f}.prof")
        print(f"PHASE {tag} rank {rank} manager {t1-began:.3f} load {t2-t1:.3f} total {seconds:.3f}", flush=True)
        job.close()
        assert resume.step is not None
        return slowest(seconds)

    out: dict = {"blocked": {"memory": [], "s3": []}, "restart": {"own": [], "peer": [], "s3": []}}
    step = 0
    for repeat in range(config["repeats"]):
        for variant in ("s3", "memory") if repeat % 2 == 0 else ("memory", "s3"):
            job = manager(variant == "memory")
            job.load_latest(state)  # a job's start: its attempt registered before it saves
            step += 1
            train_step()
            dist.barrier()
            out["blocked"][variant].append(slowest(timed(lambda j=job, s=step: j.save(s, state))))
            job.wait()  # the peer copies and the upload: before the restarts
            job.close()
        order = ("own", "peer", "s3") if repeat % 2 == 0 else ("s3", "own", "peer")
        for variant in order:
            if variant == "peer":
                dist.barrier()
                if leads_node and last_node:  # the last node is replaced: its memory is gone
                    shutil.rmtree(memory_dir, ignore_errors=True)
            out["restart"][variant].append(restart(variant != "s3", variant))
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=30.0, help="added to every S3 request")
    parser.add_argument("--mib", type=float, default=256, help="state per rank")
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=2, help="ranks per node")
    parser.add_argument(
        "--memory-root", default="/dev/shm", help="where the nodes' memory directories go"
    )
    args = parse_or_serve(parser, worker)
    if args is None:
        return
    world = args.nodes * args.per_node
    loads = [os.getloadavg()[0]]
    with (
        servers.s3_server() as s3,
        LatencyProxy(s3.endpoint_url, args.delay_ms) as proxy,
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(dir=args.memory_root, prefix="zephon-bench-") as memory_root,
    ):
        s3.create_bucket(BUCKET)
        config = {
            "endpoint": proxy.url,
            "catalog_url": f"sqlite:///{tmp}/catalog.db",
            "memory_root": memory_root,
            "per_node": args.per_node,
            "mib": args.mib,
            "tensors": args.tensors,
            "repeats": args.repeats,
            "run": "bench",
        }
        result = run_ranks(__file__, world, config, "memory tier")
        loads.append(os.getloadavg()[0])
    blocked = {k: statistics.median(v) for k, v in result["blocked"].items()}
    restart = {k: statistics.median(v) for k, v in result["restart"].items()}
    rows = [
        (
            "save blocked",
            f"{blocked['s3']:.3f}",
            f"{blocked['memory']:.3f}",
            f"{blocked['memory'] / blocked['s3']:.3f}x",
            "<= 0.05x",
        ),
        ("  each, memory", "", "/".join(f"{t:.3f}" for t in result["blocked"]["memory"]), "", ""),
        (
            "restart to first step, own memory",
            f"{restart['s3']:.3f}",
            f"{restart['own']:.3f}",
            f"{restart['s3'] / restart['own']:.1f}x faster",
            ">= 10x",
        ),
        (
            "restart to first step, peer copy",
            f"{restart['s3']:.3f}",
            f"{restart['peer']:.3f}",
            f"{restart['s3'] / restart['peer']:.1f}x faster",
            ">= 5x",
        ),
    ]
    print(
        f"{dt.date.today()}: moto S3 on 127.0.0.1 behind a proxy adding {args.delay_ms:g} ms per "
        f"request, SQLite catalog; {args.nodes} nodes x {args.per_node} ranks, {args.mib:g} MiB "
        f"per rank in {args.tensors} tensors; memory directories in {args.memory_root}; medians "
        f"of {args.repeats}; load average {' -> '.join(f'{x:.2f}' for x in loads)} (1 min)"
    )
    headers = ("operation", "S3 (s)", "memory tier (s)", "ratio", "goal")
    print(table(rows, headers))


if __name__ == "__main__":
    main()
