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
    Alternating, ``--repeats`` each, after a new save into memory (the newest: were save_dir's
    newer, every restart would rightly load it from there). Goals: >= 10x faster from
    own memory, >= 5x from the peer copy.
(c) the floor of (b) on this machine: each rank's state read back from a file in host memory
    (``--memory-root``) into its parameters, 1 MiB at a time on 4 threads with the CRC32C of
    every byte, then the step; no manager, no DCP, no fence, no catalog. Nothing that resumes
    from memory with every byte checked can be faster, so ``S3 / floor`` is the largest ratio
    (b) could show here.

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
from concurrent.futures import ThreadPoolExecutor

from _common import join_group, parse_or_serve, run_ranks, servers, table, timed
from latency_proxy import LatencyProxy
from local_tier import build_model, options_for

BUCKET = "memory-tier"


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import torch
    import torch.distributed as dist

    from zephon import CheckpointingConfig, CheckpointManager
    from zephon.storage.checksum import crc32c_extend

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

    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    floor_file = os.path.join(config["memory_root"], f"floor-rank{rank}.bin")
    offsets, offset = [], 0
    with open(floor_file, "wb") as out:
        for p in params:
            out.write(memoryview(p.detach().numpy()).cast("B"))
            offsets.append(offset)
            offset += p.numel() * p.element_size()
    reader = ThreadPoolExecutor(4)

    def read_back(index: int) -> None:
        view = memoryview(params[index].detach().numpy()).cast("B")
        fd = os.open(floor_file, os.O_RDONLY)
        try:
            done, crc = 0, 0
            while done < len(view):
                got = os.preadv(fd, [view[done : done + (1 << 20)]], offsets[index] + done)
                crc = crc32c_extend(crc, view[done : done + got])
                done += got
        finally:
            os.close(fd)

    def floor() -> float:
        """The same bytes from host memory into the model, every byte checked, then a step."""
        dist.barrier()
        began = time.perf_counter()
        list(reader.map(read_back, range(len(params))))
        train_step()
        return slowest(time.perf_counter() - began)

    def restart(memory: bool) -> float:
        """A restarted job: its manager, its resume, its first step."""
        dist.barrier()
        began = time.perf_counter()
        job = manager(memory)
        resume = job.load_latest(state)
        train_step()
        seconds = time.perf_counter() - began
        job.close()
        assert resume.step is not None
        if memory and resume.url is not None and resume.url.startswith("s3://"):
            raise AssertionError(f"a restart meant to be from memory loaded {resume.url}")
        return slowest(seconds)

    out: dict = {
        "blocked": {"memory": [], "s3": []},
        "restart": {"own": [], "peer": [], "s3": [], "floor": []},
    }
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
        if variant == "s3":  # the newest save must be in memory, or every restart is from S3
            job = manager(True)
            job.load_latest(state)
            step += 1
            job.save(step, state)
            job.wait()
            job.close()
        order = (
            ("own", "peer", "s3", "floor") if repeat % 2 == 0 else ("floor", "s3", "own", "peer")
        )
        for variant in order:
            if variant == "floor":
                out["restart"]["floor"].append(floor())
                continue
            if variant == "peer":
                dist.barrier()
                if leads_node and last_node:  # the last node is replaced: its memory is gone
                    shutil.rmtree(memory_dir, ignore_errors=True)
            out["restart"][variant].append(restart(variant != "s3"))
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
        (
            "restart floor (c): bytes + CRC32C + step",
            f"{restart['s3']:.3f}",
            f"{restart['floor']:.3f}",
            f"{restart['s3'] / restart['floor']:.1f}x (largest possible)",
            "",
        ),
        (
            "  own memory / floor, peer / floor",
            "",
            f"{restart['own'] / restart['floor']:.2f}, {restart['peer'] / restart['floor']:.2f}",
            "",
            "",
        ),
    ]
    spread = {k: f"{min(v):.3f}-{max(v):.3f}" for k, v in result["restart"].items()}
    rows.append(("  restart range s3 | own | peer | floor", "", "", "", ""))
    rows.append(
        ("", spread["s3"], f"{spread['own']} | {spread['peer']} | {spread['floor']}", "", "")
    )
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
