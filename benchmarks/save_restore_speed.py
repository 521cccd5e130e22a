"""The ``--speed`` section of ``save_restore.py``: the speed goals of one run, on S3 against
torch DCP and AWS's s3torchconnector, and locally against a plain read of the same bytes.

    python benchmarks/save_restore.py --speed [--mib 256,1024] [--repeats 3] [--backends local,s3]

For each size in ``--mib`` (total over all ranks; 256 and 1024 by default), the model + Adam
state of ``save_restore.py`` is saved and loaded by every side in turn within a repeat, the
order of the sides rotating from one repeat to the next:

- S3 (moto's server): torch's ``FsspecWriter``/``FsspecReader`` (``--dcp-threads`` files per
  rank), s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` (``--s3t-threads`` files per
  rank, the same as Zephon's by default; its own default reader), and Zephon's
  ``ZephonStorageWriter``/``ZephonStorageReader`` (``--threads``; loads verified, the default).
  Goals: save >= 1.3x s3torchconnector and >= 2x torch DCP; load >= 2x s3torchconnector.
- Client CPU: the CPU seconds (user + system, every thread) the rank processes spent in each
  timed step, summed over the ranks, per GiB of state moved (the server's CPU is not counted:
  moto's costs far more than a real object store's). Goal: Zephon <= 0.7x s3torchconnector's.
- local: Zephon's save and load (cold: evicted from the page cache; warm) against torch's
  ``FileSystemWriter``/``Reader``, and Zephon's warm load against a plain read of its own shard
  files (each rank its own, ``readinto`` into preallocated buffers of the files' sizes, on as
  many threads as Zephon's ``--threads``), back to back. Goal: warm load >= 0.8 of the plain
  read's speed.

Every load is checked bit for bit against the saved state. Ratios are the median over the
repeats of the per-repeat ratio (the sides of one repeat run back to back).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from _common import (
    Sides,
    build_state,
    empty_like_state,
    evict,
    join_group,
    s3torch_environment,
    table,
    tensors_of,
)

RUN = "bench-speed"
GIB = 1 << 30


# -- worker (one rank) ---------------------------------------------------------------------------


def shard_files(directory: str, rank: int) -> list[str]:
    """The shard files Zephon's writer wrote for ``rank`` (``__<rank>_<i>.distcp``)."""
    found = []
    for dirpath, _dirs, files in os.walk(directory):
        found += [os.path.join(dirpath, f) for f in files if f.startswith(f"__{rank}_")]
    return sorted(found)


class PlainRead:
    """A rank's shard files read whole into buffers allocated (and touched) beforehand: the
    fastest a load of those bytes can be without parsing or checking anything."""

    def __init__(self, paths: list[str], threads: int) -> None:
        import torch

        self.paths = paths
        self.buffers = [torch.zeros(os.path.getsize(p), dtype=torch.uint8) for p in paths]
        self.pool = ThreadPoolExecutor(threads)

    @staticmethod
    def _read(path: str, buffer) -> None:
        view = memoryview(buffer.numpy())
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise EOFError(f"{path}: short read at {done} of {len(view)} bytes")
                done += n

    def __call__(self) -> None:
        list(self.pool.map(self._read, self.paths, self.buffers))

    def close(self) -> None:
        self.pool.shutdown()


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from zephon import dcp as zd
    from zephon.storage import CheckpointStore

    join_group(rank, world, port, timeout=1800)
    url, options, local = config["url"], config["storage_options"], config["local"]
    if not local:
        s3torch_environment(options)
    store = CheckpointStore(url, options)
    bench = Sides(store, rank, config)
    state = build_state(rank, config["mib"] / world)
    target = empty_like_state(state)
    source_tensors, target_tensors = tensors_of(state), tensors_of(target)
    nbytes = sum(t.numel() * t.element_size() for t in source_tensors)

    def timed_with_cpu(fn) -> tuple[float, float]:
        """Wall time of the slowest rank (a barrier on each side), and the CPU seconds (user +
        system, all threads) every rank spent in ``fn``, summed over the ranks."""
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

    def measure(r: dict, key: str, fn, check: str | None = None) -> None:
        r[key], r[f"{key}_cpu"] = timed_with_cpu(fn)
        if check:
            check_loaded(check)

    records = []
    for i in range(config["repeats"]):
        name = f"speed-{i}"
        sides = [
            (
                "dcp",
                lambda n=name: dcp.save(state, storage_writer=bench.dcp_writer(n)),
                lambda n=name: dcp.load(target, storage_reader=bench.dcp_reader(n)),
                bench.dcp_dir(name),
            ),
            (
                "zephon",
                lambda s=i: zd.save(state, bench.zephon_writer(RUN, s)),
                lambda s=i: zd.load(target, zd.ZephonStorageReader(store, RUN, s)),
                store.run(RUN).checkpoint_path(i),
            ),
        ]
        if not local:
            sides.insert(
                1,
                (
                    "s3t",
                    lambda n=name: dcp.save(state, storage_writer=bench.s3t_writer(n)),
                    lambda n=name: dcp.load(target, storage_reader=bench.s3t_reader(n)),
                    bench.s3t_dir(name),
                ),
            )
        shift = i % len(sides)
        sides = sides[shift:] + sides[:shift]
        r: dict = {}
        for side, save, _load, _path in sides:
            measure(r, f"{side}_save", save)
        for side, _save, load, path in sides:
            if local:
                if rank == 0:
                    evict(path)
                measure(r, f"{side}_load_cold", load, f"{side} cold load")
                measure(r, f"{side}_load_warm", load, f"{side} warm load")
            else:
                measure(r, f"{side}_load", load, f"{side} load")
        if local:  # Zephon's warm load against a plain read of its files, back to back
            plain = PlainRead(
                shard_files(store.run(RUN).checkpoint_path(i), rank), config["threads"]
            )
            pair = [
                ("plain_read", plain, None),
                ("zephon_again", sides_load(sides, "zephon"), "zephon warm load, again"),
            ]
            for key, fn, check in pair if i % 2 else reversed(pair):
                measure(r, key, fn, check)
            r["plain_bytes"] = sum(b.numel() for b in plain.buffers)
            plain.close()
        bench.remove(RUN, [i], [name], [] if local else [name])
        records.append(r)
        if rank == 0:
            print(f"PARTIAL {config['mib']} MiB repeat {i + 1}: {json.dumps(r)}", flush=True)

    if rank == 0:
        print("RESULT " + json.dumps({"bytes_per_rank": nbytes, "records": records}), flush=True)
    store.close()
    dist.destroy_process_group()


def sides_load(sides: list[tuple], side: str):
    """The load function of the side named ``side``."""
    return next(load for name, _save, load, _path in sides if name == side)


# -- report ---------------------------------------------------------------------------------------


def _median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def _ratio(records: list[dict], over: str, under: str) -> float:
    """The median over the repeats of ``over / under`` (both measured in the same repeat)."""
    return statistics.median(r[over] / r[under] for r in records)


def _goal(ratio: float, text: str, met: bool) -> str:
    return f"{ratio:.2f} ({text} {'ok' if met else 'MISSED'})"


def report(name: str, result: dict, args, loads: tuple[float, float]) -> list[str]:
    records = result["records"]
    gib = result["bytes_per_rank"] * args.ranks / GIB
    title = (
        f"{name} --speed: {gib * 1024:.0f} MiB model+Adam state, {args.ranks} ranks, median of "
        f"{len(records)} repeats (sides rotating); Zephon thread_count={args.threads}, torch DCP "
        f"thread_count={args.dcp_threads}"
        + ("" if name == "local" else f", s3torchconnector thread_count={args.s3t_threads}")
        + f"; load average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end"
    )
    cpu_headers = ("CPU-s/GiB", "torch DCP")
    if name == "local":
        rows = []
        for op in ["save", "load_cold", "load_warm"]:
            ratio = _ratio(records, f"dcp_{op}", f"zephon_{op}")
            rows.append(
                (
                    op.replace("_", " "),
                    f"{_median(records, f'dcp_{op}'):.2f}",
                    f"{_median(records, f'zephon_{op}'):.2f}",
                    f"{ratio:.2f}",
                    f"{_median(records, f'dcp_{op}_cpu') / gib:.2f}",
                    f"{_median(records, f'zephon_{op}_cpu') / gib:.2f}",
                )
            )
        plain = _ratio(records, "plain_read", "zephon_again")
        each = " / ".join(f"{r['plain_read'] / r['zephon_again']:.2f}" for r in records)
        plain_rows = [
            (
                "warm load",
                f"{_median(records, 'plain_read'):.3f}",
                f"{_median(records, 'zephon_again'):.3f}",
                _goal(plain, ">= 0.8", plain >= 0.8) + f" [{each}]",
                f"{_median(records, 'plain_read_cpu') / gib:.2f}",
                f"{_median(records, 'zephon_again_cpu') / gib:.2f}",
            )
        ]
        return [
            title,
            table(
                rows,
                ("operation", "torch DCP s", "Zephon s", "DCP/Zephon", "CPU-s/GiB DCP", "Zephon"),
            ),
            f"{name}: Zephon's warm load vs a plain readinto of its shard files "
            f"({records[0]['plain_bytes'] / (1 << 20):.0f} MiB on rank 0, {args.threads} "
            "threads per rank)",
            table(
                plain_rows,
                (
                    "",
                    "plain read s",
                    "Zephon s",
                    "plain/Zephon [per repeat]",
                    "CPU-s/GiB plain",
                    "Zephon",
                ),
            ),
            "",
        ]
    rows = []
    for op, vs_dcp, vs_s3t in [("save", 2.0, 1.3), ("load", None, 2.0)]:
        d = _ratio(records, f"dcp_{op}", f"zephon_{op}")
        s = _ratio(records, f"s3t_{op}", f"zephon_{op}")
        rows.append(
            (
                op,
                f"{_median(records, f'dcp_{op}'):.2f}",
                f"{_median(records, f's3t_{op}'):.2f}",
                f"{_median(records, f'zephon_{op}'):.2f}",
                _goal(d, f">= {vs_dcp}", d >= vs_dcp) if vs_dcp else f"{d:.2f}",
                _goal(s, f">= {vs_s3t}", s >= vs_s3t),
            )
        )
    cpu_rows = []
    for op in ["save", "load"]:
        c = _ratio(records, f"zephon_{op}_cpu", f"s3t_{op}_cpu")
        cpu_rows.append(
            (
                op,
                f"{_median(records, f'dcp_{op}_cpu') / gib:.2f}",
                f"{_median(records, f's3t_{op}_cpu') / gib:.2f}",
                f"{_median(records, f'zephon_{op}_cpu') / gib:.2f}",
                _goal(c, "<= 0.7", c <= 0.7),
            )
        )
    return [
        title,
        table(
            rows,
            (
                "operation",
                "torch DCP s",
                "s3torchconnector s",
                "Zephon s",
                "DCP/Zephon",
                "s3torchconnector/Zephon",
            ),
        ),
        f"{name}: client CPU (the ranks' user + system seconds, summed) per GiB moved",
        table(cpu_rows, (*cpu_headers, "s3torchconnector", "Zephon", "Zephon/s3torchconnector")),
        "",
    ]
