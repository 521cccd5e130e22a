"""The local tier: how long a save blocks training with ``local_dir`` vs straight to S3, the
background upload's own time, and resume from the local tier vs from S3.

    python benchmarks/local_tier.py [--delay-ms 30] [--mib 256] [--tensors 50] [--saves 3]
                                    [--train-s S] [--local-root DIR] [--repeats 3]
                                    [--no-two-ranks]

moto's S3 server on 127.0.0.1 behind ``latency_proxy.LatencyProxy`` adding ``--delay-ms`` to
every request (a far-away object store), a SQLite catalog, and a state of ``--mib`` MiB per
rank in ``--tensors`` fp32 parameters of one model (``Shard(0)`` DTensors on 2 ranks). In one
run, on one process and on 2 gloo ranks:

(a) blocked: ``CheckpointManager.save`` (sync) with ``local_dir`` (a temporary directory: the
    save commits there, the upload to S3 goes on in the background) vs the same manager
    without one (the save writes to S3 and commits there before it returns), ``--saves``
    saves each, ``--train-s`` seconds of simulated training before each (default: 1.5 times
    the median save straight to S3, measured first), so the uploads keep up meanwhile. The
    time is each save's call, the slowest rank's. Goal: <= 0.1x.
(b) upload: the upload's own time per save (``upload_s`` from the catalog's row, else "-"),
    and how long ``wait()`` still waited after the last save.
(c) resume: ``load_latest`` of the same checkpoint, from the local tier (the manager with the
    ``local_dir`` the saves used) vs from S3 (a manager without ``local_dir``), alternating,
    ``--repeats`` each. Goal: >= 5x faster from the local tier.

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
import uuid
import warnings

from _common import join_group, parse_or_serve, run_ranks, servers, table, timed
from latency_proxy import LatencyProxy

BUCKET = "local-tier"


def options_for(endpoint: str) -> dict:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


# -- one rank (a worker process) -----------------------------------------------------------------


def build_model(mib: float, tensors: int, world: int):
    """``tensors`` fp32 parameters of ``mib`` MiB in all on this rank: ``Shard(0)`` pieces of
    tensors ``world`` times as long on 2 ranks (no communication: each rank builds its own)."""
    import torch
    from torch import nn

    rows = max(1, round(mib * 2**20 / (tensors * 1024 * 4)))
    params = [nn.Parameter(torch.randn(rows, 1024)) for _ in range(tensors)]
    if world > 1:
        from torch.distributed.tensor import DTensor, Shard, init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        params = [nn.Parameter(DTensor.from_local(p.data, mesh, [Shard(0)])) for p in params]
    model = nn.Module()
    model.weights = nn.ParameterList(params)
    return model


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import torch
    import torch.distributed as dist

    from zephon import CheckpointingConfig, CheckpointManager
    from zephon.catalog import Catalog

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if world > 1:  # one rank needs no process group
        join_group(rank, world, port, timeout=3600)

    def slowest(seconds: float) -> float:
        if world == 1:
            return seconds
        every = [0.0] * world
        dist.all_gather_object(every, seconds)
        return max(every)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    model = build_model(config["mib"], config["tensors"], world)
    state = {"model": model}
    # one node: its ranks share the local directory
    local_dir = os.path.join(config["local_root"], f"local-{config['tag']}-{world}")
    run = f"tier-{config['tag']}-{world}"

    def manager_for(variant: str, run_name: str) -> CheckpointManager:
        extra = {"local_dir": local_dir} if variant == "local" else {}
        checkpointing = CheckpointingConfig(
            save_dir=f"s3://{BUCKET}/ckpt",
            storage_options=options_for(config["endpoint"]),
            catalog_url=config["catalog_url"],
            num_to_keep=1,
            **extra,
        )
        return CheckpointManager(checkpointing, run_name=run_name, total_steps=10_000)

    out: dict = {"blocked": {}, "tail_wait": {}, "train_s": config["train_s"]}
    for variant in ("s3", "local"):
        name = run if variant == "local" else f"{run}-s3"
        manager = manager_for(variant, name)
        blocked = []
        for step in range(1, config["saves"] + 1):
            time.sleep(out["train_s"] or 0.0)  # training: the uploads go on meanwhile
            with torch.no_grad():
                for p in model.parameters():
                    (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)
            barrier()
            blocked.append(slowest(timed(lambda s=step, m=manager: m.save(s, state))))
        out["blocked"][variant] = blocked
        out["tail_wait"][variant] = slowest(timed(manager.wait))
        if out["train_s"] is None:  # save less often than a save to S3 takes: uploads keep up
            out["train_s"] = round(1.5 * statistics.median(blocked), 2)
        manager.close()

    if rank == 0:  # the phases the save path recorded on each row (older rows are deleted)
        with Catalog(config["catalog_url"]) as catalog:
            out["timings"] = [
                dict(catalog.get_checkpoint(run, s).timings or {})
                for s in range(1, config["saves"] + 1)
            ]

    loads: dict[str, list[float]] = {"local": [], "s3": []}
    for repeat in range(config["repeats"]):
        order = ("local", "s3") if repeat % 2 == 0 else ("s3", "local")
        for variant in order:
            manager = manager_for(variant, run)
            barrier()
            seconds = slowest(timed(lambda m=manager: m.load_latest(state)))
            manager.close()
            loads[variant].append(seconds)
    out["loads"] = loads
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if world > 1:
        dist.destroy_process_group()


def run_workers(world: int, config: dict) -> dict:
    return run_ranks(__file__, world, config, "local tier")


# -- report --------------------------------------------------------------------------------------


def rows_for(world: int, result: dict) -> list[tuple]:
    label = f"{world} rank{'s' if world > 1 else ''}"
    blocked = result["blocked"]
    s3, local = statistics.median(blocked["s3"]), statistics.median(blocked["local"])
    load_s3 = statistics.median(result["loads"]["s3"])
    load_local = statistics.median(result["loads"]["local"])
    uploads = [t["upload_s"] for t in result["timings"] if "upload_s" in t]
    upload = f"{statistics.median(uploads):.3f}" if uploads else "-"
    each = "/".join(f"{t:.3f}" for t in blocked["local"])
    return [
        (f"save blocked ({label})", f"{s3:.3f}", f"{local:.3f}", f"{local / s3:.3f}x", "<= 0.1x"),
        (f"  per save, local ({label})", "", each, "", ""),
        (f"  upload per save, in the background ({label})", "", upload, "", ""),
        (
            f"  wait() after the last save ({label})",
            f"{result['tail_wait']['s3']:.3f}",
            f"{result['tail_wait']['local']:.3f}",
            "",
            "",
        ),
        (
            f"resume, load_latest ({label})",
            f"{load_s3:.3f}",
            f"{load_local:.3f}",
            f"{load_s3 / load_local:.1f}x faster",
            ">= 5x",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=30.0, help="added to every S3 request")
    parser.add_argument("--mib", type=float, default=256, help="state per rank")
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument(
        "--train-s",
        type=float,
        default=None,
        help="training before each save (default: 1.5x the median save straight to S3)",
    )
    parser.add_argument(
        "--local-root",
        default=None,
        help="where local_dir goes (default: a temporary directory; /dev/shm for a RAM disk)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="resumes from each tier")
    parser.add_argument("--no-two-ranks", action="store_true", help="skip the 2-rank case")
    args = parse_or_serve(parser, worker)
    if args is None:
        return

    rows: list[tuple] = []
    loads = [os.getloadavg()[0]]
    with (
        servers.s3_server() as s3,
        LatencyProxy(s3.endpoint_url, args.delay_ms) as proxy,
        tempfile.TemporaryDirectory() as tmp,
    ):
        s3.create_bucket(BUCKET)
        config = {
            "endpoint": proxy.url,
            "catalog_url": f"sqlite:///{tmp}/catalog.db",
            "local_root": args.local_root or tmp,
            "mib": args.mib,
            "tensors": args.tensors,
            "saves": args.saves,
            "train_s": args.train_s,
            "repeats": args.repeats,
            "tag": uuid.uuid4().hex[:8],
        }
        trained = []
        for world in (1,) if args.no_two_ranks else (1, 2):
            result = run_workers(world, config)
            # the local tier of this case (under --local-root it outlives the temporary dir)
            shutil.rmtree(os.path.join(config["local_root"], f"local-{config['tag']}-{world}"))
            rows += rows_for(world, result)
            trained.append(f"{result['train_s']:g} s ({world})")
            loads.append(os.getloadavg()[0])
    print(
        f"{dt.date.today()}: moto S3 on 127.0.0.1 behind a proxy adding {args.delay_ms:g} ms per "
        f"request, SQLite catalog; {args.mib:g} MiB per rank in {args.tensors} tensors; "
        f"local_dir in {args.local_root or 'a temporary directory'}; {args.saves} saves, "
        f"training before each {', '.join(trained)} rank(s); resume median of "
        f"{args.repeats}; load average {' -> '.join(f'{x:.2f}' for x in loads)} (1 min)"
    )
    headers = ("operation", "straight to S3 (s)", "with local_dir (s)", "ratio", "goal")
    print(table(rows, headers))


if __name__ == "__main__":
    main()
