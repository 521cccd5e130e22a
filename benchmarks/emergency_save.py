"""An emergency save on preemption: how long from SIGTERM to the save committed, its peer copies
and upload done, and the job gone, against its grace period.

    python benchmarks/emergency_save.py [--mib 1024] [--grace-s 30] [--delay-ms 30]
                                        [--step-s 0.5] [--memory-root /dev/shm]
    python benchmarks/emergency_save.py --when now [--mib 256] [--step-s 10] [--grace-s 30]

Two simulated nodes of one gloo rank each, ``--mib`` MiB of state per rank (fp32 ``Shard(0)``
DTensors), moto's S3 behind a proxy adding ``--delay-ms`` to every request as save_dir, a SQLite
catalog, ``emergency_save: {signals: [SIGTERM], grace_s: --grace-s}`` and steps of ``--step-s``
seconds. Once both ranks trained a step, SIGTERM goes to both (as a scheduler sends it) and the
clock runs until both processes are gone. In one run:

- with the memory tier: the save commits into host memory, then the job waits, for what is
  left of the grace, for the peer copies and the upload to S3;
- straight to S3 (no tier): the save itself goes to S3.

Reported: the time to the commit (the emergency event's ``committed_s``), whether the upload
finished within the grace, and signal to exit, each against the grace. Goal: the emergency save
finishes within its grace.

``--when now`` compares ``when: now`` with ``when: step`` on a job whose steps are long
(``--step-s``, 10 s by default), save_dir on local disk: SIGTERM to rank 1 only, 30 % into its
fourth step; reported, for each: the time from the signal to the commit (the catalog row's
``committed_at``) and to the exit, and what ``maybe_save`` costs at a boundary (the first, which
allocates the buffers with ``when: now``, and the median of the next two), against the step
time and against copying the same tensors into existing buffers (measured in the same run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings

from _common import join_group, servers, start_ranks, table
from latency_proxy import LatencyProxy
from local_tier import build_model, options_for

BUCKET = "emergency"


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import torch

    from zephon import CheckpointingConfig, CheckpointManager, Preempted

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    join_group(rank, world, port, timeout=3600)
    model = build_model(config["mib"], 50, world)
    state = {"model": model}
    extra = (
        {"memory_tier": True, "memory_dir": os.path.join(config["memory_root"], f"node{rank}")}
        if config["memory"]
        else {}
    )
    checkpointing = CheckpointingConfig(
        save_dir=f"s3://{BUCKET}/ckpt",
        storage_options=options_for(config["endpoint"]),
        catalog_url=config["catalog_url"],
        period_steps="disable",
        emergency_save={"signals": ["SIGTERM"], "grace_s": config["grace_s"]},
        **extra,
    )
    with CheckpointManager(checkpointing, run_name=config["run"], total_steps=10**6) as manager:
        manager.load_latest(state)
        step = 0
        try:
            while True:
                step += 1
                time.sleep(config["step_s"])  # a training step
                with torch.no_grad():
                    for p in model.parameters():
                        (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)
                manager.maybe_save(step, state)
                if step == 1 and rank == 0:
                    print("TRAINING", flush=True)
        except Preempted as preempted:
            print(f"PREEMPTED {preempted.step}", flush=True)
            raise


def now_worker(rank: int, world: int, port: int, config: dict) -> None:
    """A job of long steps (a pause in the middle of each update) that reports how long each
    ``maybe_save`` took."""
    import torch

    from zephon import CheckpointingConfig, CheckpointManager

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    join_group(rank, world, port, timeout=3600)
    model = build_model(config["mib"], 50, world)
    state = {"model": model}
    checkpointing = CheckpointingConfig(
        save_dir=config["save_dir"],
        catalog_url=config["catalog_url"],
        period_steps="disable",
        emergency_save={
            "signals": ["SIGTERM"],
            "grace_s": config["grace_s"],
            "when": config["when"],
        },
    )
    # the floor: copying the same tensors into buffers that exist (the second of two rounds)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    buffers = [torch.empty_like(t) for t in local]
    for _ in range(2):
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, local, strict=True):
            buffer.copy_(tensor.detach())
        floor = time.perf_counter() - started
    del buffers
    print(f"FLOOR {floor!r}", flush=True)
    with CheckpointManager(checkpointing, run_name=config["run"], total_steps=10**6) as manager:
        manager.load_latest(state)
        for step in range(1, 10**6):
            print(f"STEP {step} {time.time()!r}", flush=True)
            time.sleep(config["step_s"] / 2)  # a long training step, updated half-way
            with torch.no_grad():
                for p in model.parameters():
                    (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)
            time.sleep(config["step_s"] / 2)
            started = time.perf_counter()
            manager.maybe_save(step, state)
            print(f"BOUNDARY {time.perf_counter() - started!r}", flush=True)


def now_case(config: dict, world: int) -> dict:
    """SIGTERM to rank 1, 30 % into its fourth step; until both ranks are gone."""
    procs = start_ranks(__file__, world, config, flag="--now-worker", stderr=subprocess.STDOUT)
    boundaries, floor = [], 0.0
    for line in procs[1].stdout:  # type: ignore[union-attr]
        if line.startswith("FLOOR"):
            floor = float(line.split()[1])
        if line.startswith("BOUNDARY"):
            boundaries.append(float(line.split()[1]))
        if line.startswith("STEP 4 "):
            break
    time.sleep(0.3 * config["step_s"])
    sent, sent_wall = time.monotonic(), time.time()
    procs[1].send_signal(signal.SIGTERM)
    outputs = [proc.communicate(timeout=3600)[0] for proc in procs]
    gone = time.monotonic() - sent
    codes = [proc.returncode for proc in procs]
    if codes != [128 + signal.SIGTERM] * world:
        raise SystemExit(f"exit codes {codes}:\n" + "\n".join(o[-3000:] for o in outputs))
    from zephon.catalog import Catalog

    with Catalog(config["catalog_url"]) as catalog:
        [row] = catalog.list_checkpoints(config["run"])
    at = row.committed_at
    assert at is not None
    committed = (at if at.tzinfo else at.replace(tzinfo=dt.UTC)).timestamp() - sent_wall
    return {
        "step": row.step,
        "committed_s": committed,
        "gone_s": gone,
        "first_s": boundaries[0],  # the copy allocates its buffers
        "boundary_s": sorted(boundaries[1:])[len(boundaries[1:]) // 2],
        "floor_s": floor,
    }


def compare_when(args: argparse.Namespace) -> None:
    world = 2
    rows = []
    loads = [os.getloadavg()[0]]
    cost: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for when in ("step", "now"):
            config = {
                "save_dir": os.path.join(tmp, "ckpt"),
                "catalog_url": f"sqlite:///{tmp}/catalog.db",
                "when": when,
                "mib": args.mib,
                "grace_s": args.grace_s,
                "step_s": args.step_s,
                "run": when,
            }
            result = now_case(config, world)
            loads.append(os.getloadavg()[0])
            cost[when] = result["boundary_s"]
            cost["floor"] = result["floor_s"]
            rows.append(
                (
                    f"when: {when}",
                    result["step"],
                    f"{result['committed_s']:.2f}",
                    f"{result['gone_s']:.2f}",
                    f"{result['gone_s'] / args.grace_s:.2f}",
                    f"{result['first_s'] * 1000:.1f}",
                    f"{result['boundary_s'] * 1000:.1f}",
                    f"{result['boundary_s'] / args.step_s:.4f}",
                )
            )
    print(
        f"{dt.date.today()}: 2 gloo ranks, {args.mib:g} MiB per rank, save_dir on local disk, "
        f"steps of {args.step_s:g} s, SIGTERM to rank 1 30 % into step 4, grace_s "
        f"{args.grace_s:g}; load average {' -> '.join(f'{x:.2f}' for x in loads)} (1 min)"
    )
    headers = (
        "case",
        "step saved",
        "signal to commit (s)",
        "signal to exit (s)",
        "of grace",
        "maybe_save, first (ms)",
        "maybe_save, then (ms)",
        "of the step",
    )
    print(table(rows, headers))
    extra = cost["now"] - cost["step"]
    print(
        f"the host copy at a boundary: {extra * 1000:.1f} ms more than when: step's boundary; "
        f"copying the same tensors into existing buffers: {cost['floor'] * 1000:.1f} ms "
        f"(the copy costs {extra / max(cost['floor'], 1e-9):.2f}x that)"
    )


def one_case(config: dict, world: int) -> dict:
    """Both ranks started; SIGTERM once rank 0 trained a step; until both are gone."""
    procs = start_ranks(__file__, world, config, flag="--worker", stderr=subprocess.STDOUT)
    for line in procs[0].stdout:  # type: ignore[union-attr]
        if line.startswith("TRAINING"):
            break
    time.sleep(1.0)
    sent = time.monotonic()
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    outputs = [proc.communicate(timeout=3600)[0] for proc in procs]
    gone = time.monotonic() - sent
    codes = [proc.returncode for proc in procs]
    if codes != [128 + signal.SIGTERM] * world:
        raise SystemExit(f"exit codes {codes}:\n" + "\n".join(o[-3000:] for o in outputs))
    from zephon.catalog import Catalog

    with Catalog(config["catalog_url"]) as catalog:
        [event] = [e for e in catalog.events(run=config["run"]) if e.action == "emergency_save"]
    line = next((x for x in outputs[0].splitlines() if "emergency save of step" in x), "")
    uploaded = re.search(r"and uploaded in ([0-9.]+) s", line)
    return {
        "gone_s": gone,
        "uploaded_s": float(uploaded.group(1)) if uploaded else None,
        **event.detail,
    }


def _uploaded(result: dict) -> str:
    """When the upload ended after the signal's save began ("-": the save was the upload)."""
    if not result.get("uploaded"):
        return "no"
    return "-" if result["uploaded_s"] is None else f"{result['uploaded_s']:.2f}"


def worker_entry() -> bool:
    entries = {"--worker": worker, "--now-worker": now_worker}
    if len(sys.argv) > 1 and sys.argv[1] in entries:
        rank, world, port, config = sys.argv[2:6]
        entries[sys.argv[1]](int(rank), int(world), int(port), json.loads(config))
        return True
    return False


def main() -> None:
    if worker_entry():
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--when",
        choices=("step", "now"),
        default="step",
        help="now: when: now against when: step, with long steps",
    )
    parser.add_argument("--mib", type=float, help="state per rank (1024; --when now: 256)")
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument("--delay-ms", type=float, default=30.0, help="added to every S3 request")
    parser.add_argument("--step-s", type=float, help="one training step (0.5; --when now: 10)")
    parser.add_argument("--memory-root", default="/dev/shm")
    args = parser.parse_args()
    now = args.when == "now"
    args.mib = args.mib if args.mib is not None else (256.0 if now else 1024.0)
    args.step_s = args.step_s if args.step_s is not None else (10.0 if now else 0.5)
    if now:
        compare_when(args)
        return
    world = 2
    rows = []
    loads = [os.getloadavg()[0]]
    with (
        servers.s3_server() as s3,
        LatencyProxy(s3.endpoint_url, args.delay_ms) as proxy,
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(dir=args.memory_root, prefix="zephon-bench-") as memory_root,
    ):
        s3.create_bucket(BUCKET)
        for memory in (True, False):
            config = {
                "endpoint": proxy.url,
                "catalog_url": f"sqlite:///{tmp}/catalog.db",
                "memory_root": memory_root,
                "memory": memory,
                "mib": args.mib,
                "grace_s": args.grace_s,
                "step_s": args.step_s,
                "run": "memory" if memory else "s3",
            }
            result = one_case(config, world)
            loads.append(os.getloadavg()[0])
            label = "memory tier" if memory else "straight to S3"
            rows.append(
                (
                    label,
                    f"{result['committed_s']:.2f}",
                    _uploaded(result),
                    f"{result['gone_s']:.2f}",
                    f"{result['gone_s'] / args.grace_s:.2f}",
                )
            )
    print(
        f"{dt.date.today()}: 2 nodes x 1 rank, {args.mib:g} MiB per rank, moto S3 behind a proxy "
        f"adding {args.delay_ms:g} ms per request, grace_s {args.grace_s:g}, steps of "
        f"{args.step_s:g} s; load average {' -> '.join(f'{x:.2f}' for x in loads)} (1 min)"
    )
    headers = (
        "emergency save",
        "committed (s)",
        "uploaded within grace (s)",
        "signal to exit (s)",
        "of grace",
    )
    print(table(rows, headers))


if __name__ == "__main__":
    main()
