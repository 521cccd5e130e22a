"""``local_dir`` behind the memory tier: what the local copy costs a save, and a restart after a
reboot (every node's memory gone) from the local disks vs from save_dir on S3.

    python benchmarks/memory_local.py [--delay-ms 30] [--mib 128] [--tensors 50] [--repeats 3]
                                      [--nodes 2] [--per-node 1] [--memory-root /dev/shm]
                                      [--local-root DIR]

moto's S3 server on 127.0.0.1 behind ``latency_proxy.LatencyProxy`` adding ``--delay-ms`` to
every request, a SQLite catalog, ``--nodes`` simulated nodes of ``--per-node`` gloo ranks
(each node a memory directory under ``--memory-root`` and a local directory under
``--local-root``, default a temporary directory on disk), ``--mib`` MiB per rank in
``--tensors`` fp32 ``Shard(0)`` parameters. In one run, alternating, ``--repeats`` each:

(a) a save with the memory tier alone vs with ``local_dir`` behind it: how long ``save``
    blocked (the slowest rank; the local copy is background work, so the ratio should be about
    1) and how long the background work took until ``wait`` returned (peer copies, the local
    copies, the upload), the slowest rank;
(b) a restart after a reboot (every node's memory directory deleted; the local disks kept): a
    new manager, ``load_latest`` and one training step, from the local disks vs from S3 (the
    memory tier alone, whose memory is gone: save_dir is loaded), the slowest rank.

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

BUCKET = "memory-local"


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import torch
    import torch.distributed as dist

    from zephon import CheckpointingConfig, CheckpointManager

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    join_group(rank, world, port, timeout=3600)
    node = rank // config["per_node"]
    memory_dir = os.path.join(config["memory_root"], f"node{node}")
    local_dir = os.path.join(config["local_root"], f"node{node}")
    leads_node = rank % config["per_node"] == 0

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

    def manager(local: bool, run: str) -> CheckpointManager:
        extra = {"local_dir": local_dir} if local else {}
        checkpointing = CheckpointingConfig(
            save_dir=f"s3://{BUCKET}/ckpt",
            storage_options=options_for(config["endpoint"]),
            catalog_url=config["catalog_url"],
            num_to_keep=1,
            memory_tier=True,
            memory_dir=memory_dir,
            **extra,
        )
        return CheckpointManager(checkpointing, run_name=run, total_steps=10_000)

    def reboot() -> None:
        dist.barrier()
        if leads_node:
            shutil.rmtree(memory_dir, ignore_errors=True)
        dist.barrier()

    out: dict = {key: {"memory": [], "local": []} for key in ("blocked", "background", "restart")}
    for repeat in range(config["repeats"]):
        for variant in ("memory", "local") if repeat % 2 == 0 else ("local", "memory"):
            run = f"{variant}-{repeat}"  # a run of its own: neither variant sees the other's
            job = manager(variant == "local", run)
            job.load_latest(state)  # a job's start: its attempt registered before it saves
            train_step()
            dist.barrier()
            out["blocked"][variant].append(slowest(timed(lambda j=job: j.save(1, state))))
            out["background"][variant].append(slowest(timed(job.wait)))
            job.close()
            reboot()
            dist.barrier()
            began = time.perf_counter()
            job = manager(variant == "local", run)
            resume = job.load_latest(state)
            train_step()
            seconds = time.perf_counter() - began
            assert resume.step == 1
            assert ("/ckpt/" not in resume.url) == (variant == "local"), resume.url
            job.close()
            out["restart"][variant].append(slowest(seconds))
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=30.0, help="added to every S3 request")
    parser.add_argument("--mib", type=float, default=128, help="state per rank")
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=1, help="ranks per node")
    parser.add_argument("--memory-root", default="/dev/shm", help="the nodes' memory directories")
    parser.add_argument("--local-root", default=None, help="the nodes' local directories")
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
        tempfile.TemporaryDirectory(dir=args.local_root, prefix="zephon-bench-") as local_root,
    ):
        s3.create_bucket(BUCKET)
        config = {
            "endpoint": proxy.url,
            "catalog_url": f"sqlite:///{tmp}/catalog.db",
            "memory_root": memory_root,
            "local_root": local_root,
            "per_node": args.per_node,
            "mib": args.mib,
            "tensors": args.tensors,
            "repeats": args.repeats,
        }
        result = run_ranks(__file__, world, config, "memory tier with local_dir")
        loads.append(os.getloadavg()[0])
    median = {k: {v: statistics.median(t) for v, t in r.items()} for k, r in result.items()}

    def row(label: str, key: str, ratio: str) -> tuple:
        memory, local = median[key]["memory"], median[key]["local"]
        shown = f"{local / memory:.2f}x" if ratio == "of" else f"{memory / local:.1f}x faster"
        return (label, f"{memory:.3f}", f"{local:.3f}", shown)

    rows = [
        row("save blocked", "blocked", "of"),
        row("background until wait() returned", "background", "of"),
        row("restart after a reboot (memory gone)", "restart", "faster"),
    ]
    print(
        f"{dt.date.today()}: moto S3 on 127.0.0.1 behind a proxy adding {args.delay_ms:g} ms per "
        f"request, SQLite catalog; {args.nodes} nodes x {args.per_node} ranks, {args.mib:g} MiB "
        f"per rank in {args.tensors} tensors; memory in {args.memory_root}, local_dir in "
        f"{args.local_root or tempfile.gettempdir()}; medians of {args.repeats}; load average "
        f"{' -> '.join(f'{x:.2f}' for x in loads)} (1 min)"
    )
    headers = ("operation", "memory alone (s)", "memory + local_dir (s)", "ratio")
    print(table(rows, headers))
    print(
        "restart: memory alone loads save_dir (S3); with local_dir, the local disks "
        "(save_dir untouched but for the attempt's claim)"
    )


if __name__ == "__main__":
    main()
