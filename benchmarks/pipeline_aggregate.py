"""The cost of a distributed pipeline checkpoint: ``checkpoint()`` on every rank of a gloo job.

Each rank runs the same pipeline in lockstep over ``aggregate_store="torch://"`` and over
``aggregate_dir`` on local disk (``--s3``: also on S3 via moto) and times ``checkpoint()`` after a
barrier, against a baseline measured in the same run: one gloo ``all_gather_object`` of
a part-sized dict (the least any exchange of the parts can cost). Rank 0 prints the medians and
each transport's median ratio to the baseline.

    python benchmarks/pipeline_aggregate.py [--ranks 4] [--repeats 30] [--s3]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import statistics
import tempfile
import time
import warnings

from _common import servers

import zephon
from tests.zephon.pipeline.util import make_dataset


def build(rank: int, ranks: int, **options) -> zephon.Pipeline:
    source = zephon.StaticMixtureWorkSource(make_dataset(shards=8, per_shard=500), chunk_size=64)
    return (
        zephon.Pipeline(source)
        .shuffle(16)
        .batch(8)
        .options(
            world_size=ranks,
            global_rank=rank,
            dp_degree=ranks,
            dp_group_id=rank,
            canonical_replicas=2 * ranks,
            **options,
        )
    )


def rank_main(rank: int, args: argparse.Namespace, port: int, agg: str, s3: dict | None) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=args.ranks,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=dt.timedelta(seconds=120),
    )
    pipelines = {
        "torch://": build(rank, args.ranks, aggregate_store="torch://", run_id="bench"),
        "aggregate_dir (local)": build(rank, args.ranks, aggregate_dir=agg, run_id="bench"),
    }
    if s3 is not None:
        pipelines["aggregate_dir (S3, moto)"] = build(
            rank, args.ranks, aggregate_dir=s3["url"], storage_options=s3["options"], run_id="b"
        )
    iterators = {name: iter(p) for name, p in pipelines.items()}
    part = pipelines["torch://"].checkpoint()  # a merged state: larger than any one part
    baseline = "baseline: all_gather_object"
    times: dict[str, list[float]] = {baseline: [], **{name: [] for name in pipelines}}
    for _ in range(args.repeats):
        for it in iterators.values():
            next(it)
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_object([None] * args.ranks, part)
        times[baseline].append(time.perf_counter() - start)
        for name, p in pipelines.items():
            dist.barrier()
            start = time.perf_counter()
            p.checkpoint()
            times[name].append(time.perf_counter() - start)
    for p in pipelines.values():
        p.close()
    if rank == 0:
        base = times[baseline]
        print(f"{args.ranks} gloo ranks, {args.repeats} checkpoints each, rank 0's times")
        print(f"{'':32} {'median ms':>10} {'x baseline':>11}")
        for name, values in times.items():
            ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
            print(f"{name:32} {1000 * statistics.median(values):10.2f} {ratio:11.1f}")
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--s3", action="store_true", help="also aggregate on S3 (moto)")
    args = parser.parse_args()
    port = servers.free_port()
    with contextlib.ExitStack() as stack:
        s3 = None
        if args.s3:
            server = stack.enter_context(servers.s3_server())
            server.create_bucket("pipeline-agg")
            s3 = {"url": "s3://pipeline-agg/agg", "options": server.storage_options()}
        agg = stack.enter_context(tempfile.TemporaryDirectory())
        mp.start_processes(
            rank_main, args=(args, port, agg, s3), nprocs=args.ranks, start_method="fork"
        )


if __name__ == "__main__":
    main()
