"""Save/restore benchmark: Zephon's DCP writer and reader against torch DCP's own.

    python benchmarks/save_restore.py [--mib 1024] [--ranks 2] [--repeats 2] [--backends local,s3]
    python benchmarks/save_restore.py --big [--big-gib 2]   # peak memory instead (see (g))
    python benchmarks/save_restore.py --speed [--mib 256,1024] [--repeats 3]   # (h) instead

Model + Adam state (fp32 Linear layers; parameters, exp_avg and exp_avg_sq) of ``--mib`` MiB in
total, split over ``--ranks`` gloo processes on the CPU, each holding its own rank-unique keys
(as sharded training does). In one run, per backend:

(a) save: ``ZephonStorageWriter`` (begin + attach + write + metadata + commit marker) vs torch's
    ``FileSystemWriter`` (local) / ``FsspecWriter`` (S3 on moto's server). Goal: ratio >= 1.2.
(b) load into preallocated state: ``ZephonStorageReader`` vs ``FileSystemReader`` /
    ``FsspecReader``. Locally twice: cold (the files evicted from the page cache with
    ``posix_fadvise``) and warm. Goal: ratio >= 1.2.
(c) async save: how long ``zephon.dcp.async_save`` (with begin and attach) blocks the caller,
    against Zephon's synchronous save. Goal: <= 0.2.
(d) verification: Zephon's load with ``verify=True`` (the default, used in (b): every slice's
    CRC32C checked as it arrives) against ``verify=False`` (sizes only), on the same checkpoint,
    locally cold and warm. Goal: ratio >= 0.95 (checking costs at most ~5%).

(f) drop-in: torch's own ``dcp.save``/``dcp.async_save``/``dcp.load`` with ``zephon.dcp.Writer``
    and ``zephon.dcp.Reader`` (one Writer for the job, ``checkpoint_id`` per save; the Reader
    with ``step=None`` finds the latest, then loads it), against the same baseline as (a) and
    (b), measured back to back; and how long ``dcp.async_save`` with the Writer and a kept
    ``ZephonStager`` blocks, against the drop-in's synchronous save. Goals as (a)-(c).

(e) fencing: Zephon's save of a fenced run (an attempt claimed and decided: ``begin`` and the
    commit each re-check that no newer attempt claimed the run, as a save without a catalog
    does) against the same save of an unfenced run, back to back; and the fence checks' own
    time (the median of many) as a share of a save. Goal: <= 2% of a save.

(g) ``--big`` (instead of (a)-(f)): peak RSS of a rank process during a sync save, an async
    save and a load of ``--big-gib`` GiB per rank, divided by the state's bytes, for Zephon and
    the same baseline as (a) and (b) (``benchmarks/save_restore_memory.py``). Goal: <= 1.25
    for Zephon's sync save and load.

(h) ``--speed`` (instead of (a)-(f)): the speed goals, per size of ``--mib`` (256 and 1024 MiB
    by default): on S3, save and load against torch DCP and AWS's s3torchconnector
    (``pip install -r benchmarks/requirements.txt``), with the client CPU seconds per GiB of
    each side; locally, the warm load against a plain ``readinto`` of the same shard files
    (``benchmarks/save_restore_speed.py``).

Ratios are baseline time / Zephon time (in (d): unverified / verified): above 1 means the
second is faster. Times are medians over ``--repeats``; a ratio is the median of the per-repeat
ratios, each from the two sides measured back to back (their order alternates per repeat),
which keeps the load of a shared machine out of it. A timed step starts and ends with a
barrier: the slowest rank's time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid

import save_restore_memory as big
import save_restore_speed as speed
from _common import (
    Sides,
    build_state,
    empty_like_state,
    evict,
    join_group,
    parse_or_serve,
    run_ranks,
    s3torch_missing,
    servers,
    table,
    tensors_of,
)

RUN = "bench"
FENCED_RUN = "bench-fenced"
DROPIN_RUN = "bench-dropin"


# -- worker (one rank) ---------------------------------------------------------------------------


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from zephon import dcp as zd
    from zephon.storage import CheckpointStore

    join_group(rank, world, port, timeout=1800)
    ckpt_group = dist.new_group(backend="gloo")
    url, options, local = config["url"], config["storage_options"], config["local"]
    store = CheckpointStore(url, options)
    bench = Sides(store, rank, config)
    state = build_state(rank, config["mib"] / world)
    target = empty_like_state(state)
    source_tensors, target_tensors = tensors_of(state), tensors_of(target)
    nbytes = sum(t.numel() * t.element_size() for t in source_tensors)
    # A job keeps one stager: its buffers are allocated by the first async save (here, untimed)
    # and reused by every later one.
    stager = zd.ZephonStager()
    stager.stage(state)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def timed_with_cpu(fn) -> tuple[float, float]:
        """``timed``, plus the CPU seconds (user + system, all threads) every rank spent in
        ``fn``, summed: the cost that other tenants of a shared machine do not inflate."""
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        cpu = time.process_time() - cpu
        dist.barrier()
        wall = time.perf_counter() - start
        spent = [0.0] * world
        dist.all_gather_object(spent, cpu)
        return wall, sum(spent)

    def check_loaded(label: str) -> None:
        for a, b in zip(source_tensors, target_tensors, strict=True):
            if not torch.equal(a, b):
                raise AssertionError(f"{label}: loaded state differs from the saved state")
            b.zero_()

    def dcp_save(i: int) -> None:
        dcp.save(state, storage_writer=bench.dcp_writer(f"baseline-{i}"))

    def dcp_load(i: int) -> None:
        dcp.load(target, storage_reader=bench.dcp_reader(f"baseline-{i}"))

    fence = None
    if rank == 0:  # one attempt of the fenced run, as a job start registers it
        claimed = store.run(FENCED_RUN).claim_attempt(after=store.run(FENCED_RUN).lineage())
        fence = store.run(FENCED_RUN).decide_resume(claimed, None)

    def zephon_writer(step: int, run: str = RUN) -> zd.ZephonStorageWriter:
        return bench.zephon_writer(run, step, fence=fence if run == FENCED_RUN else None)

    def zephon_save(step: int, run: str = RUN) -> None:
        zd.save(state, zephon_writer(step, run))

    def fence_check_seconds() -> float:
        """Both of a save's fence checks (begin and before the marker), median of many."""
        samples = []
        for _ in range(30):
            start = time.perf_counter()
            store.run(FENCED_RUN).check_fence(fence)
            samples.append(time.perf_counter() - start)
        return 2 * statistics.median(samples)

    def zephon_load(step: int, verify: bool = True) -> None:
        zd.load(target, zd.ZephonStorageReader(store, RUN, step, verify=verify))

    # (f) the drop-in path: torch's own dcp.save/async_save/load with zephon.dcp.Writer/Reader,
    # one Writer for the whole job (its first save registers the attempt, untimed here)
    dropin_url = f"{url}/{DROPIN_RUN}"
    dropin = zd.Writer(dropin_url, storage_options=options, thread_count=config["threads"])
    dcp.save(state, storage_writer=dropin, checkpoint_id=f"{dropin_url}/save-999999")
    dist.barrier()
    if rank == 0:
        store.run(DROPIN_RUN).delete(999999)
    dist.barrier()

    def dropin_save(step: int) -> None:
        dcp.save(state, storage_writer=dropin, checkpoint_id=f"{dropin_url}/save-{step}")

    def dropin_load() -> None:  # step=None: the latest complete checkpoint, found then loaded
        reader = zd.Reader(dropin_url, storage_options=options)
        dcp.load(target, storage_reader=reader)

    records = []
    for i in range(config["repeats"]):
        step = 2 * i
        r: dict = {}
        sides = [
            (
                "dcp",
                lambda i=i: dcp_save(i),
                lambda i=i: dcp_load(i),
                bench.dcp_dir(f"baseline-{i}"),
            ),
            (
                "zephon",
                lambda s=step: zephon_save(s),
                lambda s=step: zephon_load(s),
                store.run(RUN).checkpoint_path(step),
            ),
        ]
        if i % 2:
            sides.reverse()
        for name, save, _load, _path in sides:
            r[f"{name}_save"] = timed(save)
        for name, _save, load, path in sides:
            if local:
                if rank == 0:
                    evict(path)
                r[f"{name}_load_cold"] = timed(load)
                check_loaded(f"{name} cold load")
                r[f"{name}_load_warm"] = timed(load)
                check_loaded(f"{name} warm load")
            else:
                r[f"{name}_load"] = timed(load)
                check_loaded(f"{name} load")

        # drop-in: the same save and load against the same baseline, back to back
        drop_sides = [
            (
                "dcp",
                lambda i=i: dcp_save(i + 1000),
                lambda i=i: dcp_load(i + 1000),
                bench.dcp_dir(f"baseline-{i + 1000}"),
            ),
            (
                "dropin",
                lambda s=step: dropin_save(s),
                dropin_load,
                store.run(DROPIN_RUN).checkpoint_path(step),
            ),
        ]
        if i % 2:
            drop_sides.reverse()
        for name, save, _load, _path in drop_sides:
            r[f"{name}2_save"] = timed(save)
        for name, _save, load, path in drop_sides:
            for mode in ["load_cold", "load_warm"] if local else ["load"]:
                if mode == "load_cold" and rank == 0:
                    evict(path)
                r[f"{name}2_{mode}"] = timed(load)
                check_loaded(f"{name} drop-in comparison {mode}")
        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save(
            state,
            storage_writer=dropin,
            checkpoint_id=f"{dropin_url}/save-{step + 1}",
            process_group=ckpt_group,
            async_stager=stager,
        )
        blocked = time.perf_counter() - start
        future.result()
        blocks = [None] * world
        dist.all_gather_object(blocks, blocked)
        r["dropin_async_block"] = max(blocks)
        bench.remove(DROPIN_RUN, [step, step + 1], [f"baseline-{i + 1000}"])

        # verification: the same checkpoint loaded with and without it, back to back
        checks = [("unverified", False), ("verified", True)]
        if i % 2:
            checks.reverse()
        for mode in ["load_cold", "load_warm"] if local else ["load"]:
            for label, verify in checks:
                if mode == "load_cold" and rank == 0:
                    evict(store.run(RUN).checkpoint_path(step))
                wall, cpu = timed_with_cpu(lambda s=step, v=verify: zephon_load(s, v))
                r[f"{label}_{mode}"], r[f"{label}_{mode}_cpu"] = wall, cpu
                check_loaded(f"{label} {mode}")

        # fencing: the same save, of a fenced and of an unfenced run, back to back
        fencing = [("unfenced_save", RUN), ("fenced_save", FENCED_RUN)]
        if i % 2:
            fencing.reverse()
        for label, run in fencing:
            r[label] = timed(lambda s=step, run=run: zephon_save(s + 100, run))
        if rank == 0:
            r["fence_checks"] = fence_check_seconds()
            store.run(RUN).delete(step + 100)
            store.run(FENCED_RUN).delete(step + 100)
        dist.barrier()

        # async: what the training loop waits for, then the whole background save
        dist.barrier()
        start = time.perf_counter()
        future = zd.async_save(
            state, zephon_writer(step + 1), process_group=ckpt_group, stager=stager
        )
        blocked = time.perf_counter() - start
        future.result()
        done = time.perf_counter() - start
        blocks = [None] * world
        dist.all_gather_object(blocks, (blocked, done))
        r["async_block"] = max(b[0] for b in blocks)
        r["async_total"] = max(b[1] for b in blocks)
        zephon_load(step + 1)
        check_loaded("async save")

        bench.remove(RUN, [step, step + 1], [f"baseline-{i}"])
        records.append(r)

    if rank == 0:
        print("RESULT " + json.dumps({"bytes_per_rank": nbytes, "records": records}), flush=True)
    dropin.close()
    store.close()
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------------


def run_backend(name: str, url: str, options: dict, args, mib: int) -> dict:
    config = {
        "url": url,
        "storage_options": options,
        "local": name == "local",
        "mib": mib,
        "repeats": args.repeats,
        "threads": args.threads,
        "dcp_threads": args.dcp_threads,
        "s3t_threads": args.s3t_threads,
        "section": "big" if args.big else "speed" if args.speed else "all",
        "gib": args.big_gib,
    }
    what = f"{name} --big {args.big_gib} GiB per rank" if args.big else f"{name} {mib} MiB"
    return run_ranks(__file__, args.ranks, config, what)


def any_worker(rank: int, world: int, port: int, config: dict) -> None:
    """A rank of the time comparison, with ``--speed`` of the speed goals, with ``--big`` of the
    memory one."""
    workers = {"all": worker, "speed": speed.worker, "big": big.worker}
    workers[config["section"]](rank, world, port, config)


def median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def per_repeat(records: list[dict], over: str, under: str) -> float:
    """The median over the repeats of ``over / under``. Each repeat measures both sides
    back to back, so their ratio is robust to the load of a shared machine drifting between
    repeats: the figure is the median of those ratios, not the ratio of the medians."""
    return statistics.median(r[over] / r[under] for r in records)


def goal(text: str, met: bool) -> str:
    """The goal column: the goal, then whether this run met it."""
    return f"{text} {'ok' if met else 'MISSED'}"


def report(name: str, result: dict, args) -> list[str]:
    records = result["records"]
    total_mib = result["bytes_per_rank"] * args.ranks / (1 << 20)
    baseline = "FileSystemWriter/Reader" if name == "local" else "FsspecWriter/Reader"
    rows = []
    loads = ["load_cold", "load_warm"] if name == "local" else ["load"]
    for op in ["save", *loads]:
        base, zep = median(records, f"dcp_{op}"), median(records, f"zephon_{op}")
        ratio = per_repeat(records, f"dcp_{op}", f"zephon_{op}")
        rows.append(
            (
                op.replace("_", " "),
                f"{base:.2f}",
                f"{total_mib / base:.0f}",
                f"{zep:.2f}",
                f"{total_mib / zep:.0f}",
                f"{ratio:.2f}",
                goal(">= 1.2", ratio >= 1.2),
            )
        )
    block, total = median(records, "async_block"), median(records, "async_total")
    blocked = per_repeat(records, "async_block", "zephon_save")
    rows.append(
        (
            "async blocks",
            "",
            "",
            f"{block:.2f}",
            f"(all done {total:.2f} s)",
            f"{blocked:.2f}",
            goal("<= 0.2", blocked <= 0.2),
        )
    )
    headers = ("operation", "DCP s", "MiB/s", "Zephon s", "MiB/s", "ratio", "goal")
    title = (
        f"{name}: {total_mib:.0f} MiB model+Adam state, {args.ranks} ranks, median of "
        f"{len(records)}; baseline torch {baseline} (thread_count={args.dcp_threads}), "
        f"Zephon thread_count={args.threads}"
    )
    checks = []
    for op in loads:
        plain, checked = median(records, f"unverified_{op}"), median(records, f"verified_{op}")
        each = [r[f"unverified_{op}"] / r[f"verified_{op}"] for r in records]
        ratio = statistics.median(each)
        cpu_plain = median(records, f"unverified_{op}_cpu")
        cpu_checked = median(records, f"verified_{op}_cpu")
        cpu_ratio = per_repeat(records, f"unverified_{op}_cpu", f"verified_{op}_cpu")
        checks.append(
            (
                op.replace("_", " "),
                f"{plain:.2f}",
                f"{total_mib / plain:.0f}",
                f"{checked:.2f}",
                f"{total_mib / checked:.0f}",
                f"{ratio:.2f} ({' / '.join(f'{x:.2f}' for x in each)})",
                f"{cpu_plain:.2f} / {cpu_checked:.2f} = {cpu_ratio:.2f}",
                goal(">= 0.95", ratio >= 0.95),
            )
        )
    check_headers = ("Zephon load", "verify=False s", "MiB/s", "verify=True s", "MiB/s")
    unfenced, fenced = median(records, "unfenced_save"), median(records, "fenced_save")
    extra = per_repeat(records, "fenced_save", "unfenced_save") - 1
    checks_s = median(records, "fence_checks")
    share = per_repeat(records, "fence_checks", "unfenced_save")
    fencing = [
        (
            "save",
            f"{unfenced:.2f}",
            f"{fenced:.2f}",
            f"{100 * extra:+.1f}%",
            f"{1000 * checks_s:.1f} ms = {100 * share:.2f}%",
            goal("<= 2%", share <= 0.02),
        )
    ]
    fence_headers = ("Zephon", "unfenced s", "fenced s", "end to end", "fence checks", "goal")
    dropin = []
    for op in ["save", *loads]:
        base, zep = median(records, f"dcp2_{op}"), median(records, f"dropin2_{op}")
        ratio = per_repeat(records, f"dcp2_{op}", f"dropin2_{op}")
        dropin.append(
            (
                op.replace("_", " "),
                f"{base:.2f}",
                f"{zep:.2f}",
                f"{ratio:.2f}",
                goal(">= 1.2", ratio >= 1.2),
            )
        )
    block = median(records, "dropin_async_block")
    blocked = per_repeat(records, "dropin_async_block", "dropin2_save")
    dropin.append(
        (
            "async blocks",
            "",
            f"{block:.2f}",
            f"{blocked:.2f}",
            goal("<= 0.2", blocked <= 0.2),
        )
    )
    return [
        title,
        table(rows, headers),
        f"{name}: verification on load (every slice's CRC32C), same checkpoint back to back; "
        "CPU s: all ranks' CPU time, False / True",
        table(checks, (*check_headers, "ratio (per repeat)", "CPU s", "goal")),
        f"{name}: fencing on save (the run's attempt re-checked at begin and before the marker)",
        table(fencing, fence_headers),
        f"{name}: drop-in path (torch's dcp.save/async_save/load with zephon.dcp.Writer/Reader, "
        "load with step=None) vs the same baseline, back to back; async: share of its sync save",
        table(dropin, ("operation", "DCP s", "drop-in s", "ratio", "goal")),
        "",
    ]


def sizes(text: str) -> list[int]:
    """``--mib``: comma-separated sizes in MiB."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of MiB: use e.g. 256,1024")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mib",
        type=sizes,
        default=None,
        help="total state size over all ranks; a comma-separated list runs each "
        "(default 1024, with --speed 256,1024)",
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help="default 2, with --speed 3")
    parser.add_argument("--backends", default="local,s3")
    parser.add_argument("--threads", type=int, default=4, help="Zephon writer files per rank")
    parser.add_argument("--dcp-threads", type=int, default=1, help="DCP writer thread_count")
    parser.add_argument(
        "--s3t-threads",
        type=int,
        default=None,
        help="--speed: s3torchconnector writer thread_count (default: --threads)",
    )
    parser.add_argument("--dir", default=None, help="local directory (default: a temp dir)")
    parser.add_argument("--verbose", action="store_true", help="print every repeat's times")
    parser.add_argument(
        "--speed",
        action="store_true",
        help="the speed goals only (h): S3 vs torch DCP and s3torchconnector with client "
        "CPU-s/GiB, warm local load vs a plain read",
    )
    parser.add_argument(
        "--big", action="store_true", help="measure peak memory of a big state instead (g)"
    )
    parser.add_argument("--big-gib", type=float, default=2.0, help="--big: GiB of state per rank")
    args = parse_or_serve(parser, any_worker)
    if args is None:
        return
    if args.mib is None:
        args.mib = [256, 1024] if args.speed else [1024]
    if args.repeats is None:
        args.repeats = 3 if args.speed else 2
    args.s3t_threads = args.s3t_threads or args.threads
    backends = args.backends.split(",")
    if args.big:  # --big-gib sets its size
        args.mib = args.mib[:1]
        big.check_memory(args)
    if args.speed and "s3" in backends and (missing := s3torch_missing()):
        raise SystemExit(f"--speed compares with s3torchconnector on S3, but {missing}")
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    for name in backends:
        if name == "local":
            base = tempfile.mkdtemp(prefix="zephon-bench-", dir=args.dir)
            try:
                for mib in args.mib:
                    url = os.path.join(base, f"ckpt-{mib}")
                    show(name, url, {}, args, mib)
            finally:
                shutil.rmtree(base, ignore_errors=True)
        elif name == "s3":
            with servers.s3_server() as s3:
                options = s3.storage_options()
                if args.big:  # moto takes minutes to assemble GiB-sized multipart uploads
                    options["config_kwargs"] = {"read_timeout": 1800}
                for mib in args.mib:
                    bucket = f"bench-{uuid.uuid4().hex[:8]}"
                    s3.create_bucket(bucket)
                    url = f"s3://{bucket}/ckpt"
                    show(name, url, options, args, mib)
        else:
            raise SystemExit(f"unknown backend {name!r}: use local and/or s3")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def show(name: str, url: str, options: dict, args, mib: int) -> None:
    """Run one backend at one size and print its section."""
    start = os.getloadavg()[0]
    result = run_backend(name, url, options, args, mib)
    loads = (start, os.getloadavg()[0])
    if args.verbose and not args.big:
        for record in result["records"]:
            print(name, json.dumps({k: round(v, 3) for k, v in record.items()}), flush=True)
    if args.big:
        section = big.report(name, result, args)
    elif args.speed:
        section = speed.report(name, result, args, loads)
    else:
        section = report(name, result, args)
    print("\n".join(section), flush=True)


if __name__ == "__main__":
    main()
