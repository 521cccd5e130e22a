"""The ``--big`` section of ``save_restore.py``: peak memory of saving and loading a big state.

    python benchmarks/save_restore.py --big [--big-gib 2] [--ranks 2] [--backends local,s3]

Every rank holds ``--big-gib`` GiB of fp32 tensors (one 512 MiB embedding-like tensor, the rest
64 MiB matrices and small vectors: items far larger than a request or an upload part). The
figure is the rank process's peak resident set during one operation divided by the state's
bytes: the state itself counts (a ratio of 1.0 is the state and nothing else), and so does
everything the interpreter, torch and gloo hold. The peak is the kernel's own high-water mark
(``VmHWM``), reset right before each operation (``/proc/self/clear_refs``), so every operation
is measured in the same process on its own. Per backend, back to back:

- sync save: Zephon's ``ZephonStorageWriter`` vs torch's ``FileSystemWriter`` (local) /
  ``FsspecWriter`` (S3 on moto's server);
- async save until its future completes (local disk only: moto's server holds about three times
  what it assembles): ``zephon.dcp.async_save`` with a ``ZephonStager`` vs ``dcp.async_save``
  with DCP's default stager: both stage a full copy into host memory by design, so about 2.0 is
  expected;
- load into the preallocated state (DCP loads in place): ``ZephonStorageReader`` with
  verification vs ``FileSystemReader`` / ``FsspecReader``.

Goal for Zephon's sync save and load: <= 1.25. Every load is checked bit for bit (the CRC32C of
every tensor before the save and after the load).
"""

from __future__ import annotations

import gc
import json
import re
import time

from _common import Sides, join_group, table

RUN = "bench-big"
GOAL = 1.25
_MIB = 1 << 20


def reset_peak() -> None:
    """Set this process's peak RSS (VmHWM) back to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss(field: str = "VmHWM") -> int:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident set, in bytes."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None, f"no {field} in /proc/self/status"
    return int(match.group(1)) * 1024


def available_bytes() -> int:
    """The machine's MemAvailable, in bytes."""
    with open("/proc/meminfo") as f:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def build_big_state(rank: int, nbytes: int):
    """At least ``nbytes`` of fp32 tensors, built in place (no temporary copies)."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    embedding = min(512 * _MIB, nbytes // 4)
    state: dict = {"embedding": torch.empty(embedding // 4).uniform_(generator=generator)}
    layers: dict = {}
    left, i = nbytes - embedding, 0
    while left > 0:
        width = 4096 if left >= 64 * _MIB else max(1, int((left / 4) ** 0.5))
        layers[f"{i}.weight"] = torch.empty(width, width).uniform_(generator=generator)
        layers[f"{i}.bias"] = torch.empty(width).uniform_(generator=generator)
        left -= width * width * 4
        i += 1
    state["layers"] = layers
    return {f"rank{rank}": state}


def _tensors(state) -> list:
    import torch

    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return [state] if isinstance(state, torch.Tensor) else []


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from zephon import dcp as zd
    from zephon.storage import CheckpointStore
    from zephon.storage.checksum import crc32c_extend

    join_group(rank, world, port, timeout=1800)
    ckpt_group = dist.new_group(backend="gloo")
    store = CheckpointStore(config["url"], config["storage_options"])
    bench = Sides(store, rank, config)
    before_state = rss("VmRSS")
    state = build_big_state(rank, int(config["gib"] * (1 << 30)))
    tensors = _tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    crcs = [crc32c_extend(0, t.numpy()) for t in tensors]

    r: dict = {}
    peaks: list[dict] = [{} for _ in range(world)]

    def measure(key: str, fn) -> None:
        """Seconds (slowest rank) and every rank's peak RSS while ``fn`` runs, printed at once
        (a later phase that fails or is stopped keeps the earlier figures)."""
        gc.collect()
        dist.barrier()
        reset_peak()
        start = time.perf_counter()
        fn()
        peak = rss()
        dist.barrier()
        r[key] = time.perf_counter() - start
        gathered = [None] * world
        dist.all_gather_object(gathered, peak)
        for mine, p in zip(peaks, gathered, strict=True):
            mine[key] = p
        if rank == 0:
            print(f"PARTIAL {key} {r[key]:.1f} s, peaks {gathered}", flush=True)

    def check_and_clear(label: str) -> None:
        for t, crc in zip(tensors, crcs, strict=True):
            if crc32c_extend(0, t.numpy()) != crc:
                raise AssertionError(f"{label}: loaded state differs from the saved state")
            t.zero_()

    def zephon_async() -> None:
        stager = zd.ZephonStager()
        writer = bench.zephon_writer(RUN, 2)
        zd.async_save(state, writer, process_group=ckpt_group, stager=stager).result()
        stager.close()

    def dcp_async() -> None:
        writer = bench.dcp_writer("async")
        dcp.async_save(state, storage_writer=writer, process_group=ckpt_group).result()

    measure("zephon_save", lambda: zd.save(state, bench.zephon_writer(RUN, 1)))
    measure("dcp_save", lambda: dcp.save(state, storage_writer=bench.dcp_writer("sync")))
    for t in tensors:
        t.zero_()
    measure("zephon_load", lambda: zd.load(state, zd.ZephonStorageReader(store, RUN, 1)))
    check_and_clear("zephon load")
    measure("dcp_load", lambda: dcp.load(state, storage_reader=bench.dcp_reader("sync")))
    check_and_clear("dcp load")
    bench.remove(RUN, [1], ["sync"])
    if bench.local:
        # Not on moto: it holds about three times what it is assembling, which a 24 GiB
        # machine cannot hold beside two ranks' staged copies. The copy is the same anywhere.
        measure("zephon_async", zephon_async)
        bench.remove(RUN, [2], [])
        measure("dcp_async", dcp_async)
        bench.remove(RUN, [], ["async"])
    if rank == 0:
        result = {
            "bytes_per_rank": nbytes,
            "rss_before_state": before_state,
            "seconds": r,
            "peaks": peaks,
        }
        print("RESULT " + json.dumps(result), flush=True)
    store.close()
    dist.destroy_process_group()


def check_memory(args) -> None:
    """Refuse to start a case the machine cannot hold right now (it is shared)."""
    # Each rank holds its state, twice during the async saves; moto keeps a file's parts too.
    needed = int(args.ranks * args.big_gib * 2.6 * (1 << 30))
    have = available_bytes()
    if have < needed:
        raise SystemExit(
            f"--big needs about {needed / (1 << 30):.1f} GiB of free memory for {args.ranks} "
            f"ranks x {args.big_gib} GiB, the machine has {have / (1 << 30):.1f} GiB available "
            "now: wait for other jobs, or pass a smaller --big-gib"
        )


def report(name: str, result: dict, args) -> list[str]:
    nbytes = result["bytes_per_rank"]
    peaks = result["peaks"]
    seconds = result["seconds"]
    baseline = "FileSystemWriter/Reader" if name == "local" else "FsspecWriter/Reader"

    def ratio(key: str) -> float:  # the worst rank
        return max(p[key] for p in peaks) / nbytes

    rows = []
    for label, key, goal in [
        ("sync save", "save", True),
        ("async save", "async", False),
        ("load", "load", True),
    ]:
        if f"zephon_{key}" not in seconds:
            continue
        z, d = ratio(f"zephon_{key}"), ratio(f"dcp_{key}")
        verdict = (f"<= {GOAL} " + ("ok" if z <= GOAL else "MISSED")) if goal else "(a copy)"
        rows.append(
            (
                label,
                f"{max(p[f'dcp_{key}'] for p in peaks) / (1 << 30):.2f}",
                f"{d:.2f}",
                f"{seconds[f'dcp_{key}']:.1f}",
                f"{max(p[f'zephon_{key}'] for p in peaks) / (1 << 30):.2f}",
                f"{z:.2f}",
                f"{seconds[f'zephon_{key}']:.1f}",
                verdict,
            )
        )
    headers = ("operation", "DCP GiB", "ratio", "s", "Zephon GiB", "ratio", "s", "goal")
    title = (
        f"{name} --big: peak RSS per rank / state bytes, {nbytes / (1 << 30):.2f} GiB per rank, "
        f"{args.ranks} ranks (worst rank); baseline torch {baseline}; the process held "
        f"{result['rss_before_state'] / (1 << 20):.0f} MiB before the state was built"
    )
    return [title, table(rows, headers), ""]
