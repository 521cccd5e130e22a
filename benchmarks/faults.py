"""Saves through a misbehaving network: how many succeed and what they cost at 1 %, 5 % and 20 %
injected faults, and how soon save_dir holds every retained step after a long outage.

    python benchmarks/faults.py [--mib 16] [--tensors 8] [--saves 10] [--rates 0.01,0.05,0.2]
                                [--outage-s 60] [--seed 7]

moto's S3 server on 127.0.0.1 behind ``tests/faults.FaultProxy``, a SQLite catalog, one process,
a state of ``--mib`` MiB in ``--tensors`` fp32 tensors, the checkpoint manager with its default
retry policy.

(a) rates: ``--saves`` synchronous saves straight to S3 per fault rate, the rate split over the
    proxy's faults (30 % 500 InternalError, 20 % 503 SlowDown, 20 % resets before the
    request reached the server, 10 % requests applied whose reply is lost, 20 % truncated
    replies); then ``load_latest``, through the same faults, into a fresh
    state, which must equal the last saved one bit for bit. Reported against the fault-free
    saves of the same run: the share of saves that succeeded, the median time per save and
    the extra time per save. Goal: every save succeeds and the state comes back exact.
(b) outage: a manager with a local tier (``local_dir``, ``num_to_keep`` 3) saves step 1, the
    store goes down (every request reset) for ``--outage-s`` seconds, during which steps 2 and 3
    are saved (they commit locally; their uploads fail and wait), then the store comes back.
    Reported: the time from recovery until save_dir holds a committed marker for every
    retained step, against the upload time of one step without faults (step 1's). Goal: every
    retained step reaches save_dir, within a few upload times of recovery.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import threading
import time
import uuid
import warnings

from _common import servers, table, timed

from tests.faults import FaultProxy

BUCKET = "faults"
#: how a fault rate is split over the proxy's kinds of fault
MIX = {"error": 0.3, "slow_down": 0.2, "reset": 0.2, "drop": 0.1, "truncate": 0.2}


def options_for(endpoint: str) -> dict:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


def make_state(mib: float, tensors: int, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    numel = max(1, round(mib * 2**20 / (tensors * 4)))
    return {"model": {f"w{i}": torch.randn(numel, generator=generator) for i in range(tensors)}}


def same(a, b) -> bool:
    import torch

    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def manager_for(config: dict, run: str, **extra):
    from zephon import CheckpointingConfig, CheckpointManager

    checkpointing = CheckpointingConfig(
        save_dir=f"s3://{BUCKET}/ckpt",
        storage_options=options_for(config["endpoint"]),
        catalog_url=config["catalog_url"],
        num_to_keep=3,
        **extra,
    )
    return CheckpointManager(checkpointing, run_name=run, total_steps=10_000)


def rate_case(proxy: FaultProxy, config: dict, rate: float) -> dict:
    """``config['saves']`` saves at ``rate`` injected faults; their outcomes and times."""
    run = f"rate-{rate:g}-{config['tag']}"
    manager = manager_for(config, run)  # set up without faults: the saves are measured
    proxy.clear()
    proxy.set_rates(**{kind: rate * share for kind, share in MIX.items()})
    times, failures, last_saved = [], [], None
    for step in range(1, config["saves"] + 1):
        state = make_state(config["mib"], config["tensors"], seed=step)
        started = time.perf_counter()
        try:
            manager.save(step, state)
        except BaseException as exc:  # noqa: BLE001 - counted and reported, one line each
            failures.append(f"step {step}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        times.append(time.perf_counter() - started)
        last_saved = state
    exact = None
    if last_saved is not None:  # the load goes through the same faults
        fresh = make_state(config["mib"], config["tensors"], seed=10_000)
        try:
            # plain tensors come back in the resume's values (modules would be loaded in place)
            exact = same(manager.load_latest(fresh).values, last_saved)
        except BaseException as exc:  # noqa: BLE001 - reported as a failed load
            exact = False
            failures.append(f"load: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    injected = sum(1 for r in proxy.log if r.outcome != "ok")
    proxy.set_rates()
    manager.close()
    return {
        "rate": rate,
        "ok": len(times),
        "times": times,
        "failures": failures,
        "injected": injected,
        "requests": len(proxy.log),
        "exact": exact,
    }


def outage_case(proxy: FaultProxy, config: dict, store_url: str) -> dict:
    """Step 1 uploaded, steps 2 and 3 saved during an outage; seconds from recovery until
    save_dir has every retained step, and step 1's upload time without faults."""
    from zephon.storage import CheckpointStore

    run = f"outage-{config['tag']}"
    local_dir = os.path.join(config["tmp"], "local")
    manager = manager_for(config, run, local_dir=local_dir, local_num_to_keep=3)
    direct = CheckpointStore(store_url, options_for(config["s3_endpoint"]))
    first = make_state(config["mib"], config["tensors"], 1)
    clean_upload = timed(lambda: (manager.save(1, first), manager.wait()))
    proxy.outage(True)
    outage_started = time.perf_counter()
    saved_during = []
    for step in (2, 3):
        manager.save(step, make_state(config["mib"], config["tensors"], step))
        saved_during.append(step)
    time.sleep(max(0.0, config["outage_s"] - (time.perf_counter() - outage_started)))
    proxy.outage(False)
    recovered = time.perf_counter()
    errors: list[str] = []

    def wait() -> None:
        try:
            manager.wait()
        except BaseException as exc:  # noqa: BLE001 - reported
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    reached = None
    deadline = recovered + max(120.0, 4 * config["outage_s"])
    while time.perf_counter() < deadline:
        if set(direct.run(run).committed_steps()) >= {1, 2, 3}:
            reached = time.perf_counter() - recovered
            break
        time.sleep(0.1)
    waiter.join(timeout=max(1.0, deadline - time.perf_counter()))
    with_steps = sorted(direct.run(run).committed_steps())
    manager.close()
    direct.close()
    return {
        "clean_upload": clean_upload,
        "reached": reached,
        "on_save_dir": with_steps,
        "errors": errors,
        "outage_s": config["outage_s"],
        "saved_during": saved_during,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=16, help="state per save")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--saves", type=int, default=10, help="saves per fault rate")
    parser.add_argument("--rates", default="0.01,0.05,0.2", help="injected fault rates")
    parser.add_argument("--outage-s", type=float, default=60.0, help="0 skips the outage case")
    parser.add_argument("--seed", type=int, default=7, help="the proxy's random faults")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rates = [float(r) for r in args.rates.split(",") if r.strip()]

    loads = [os.getloadavg()[0]]
    with (
        servers.s3_server() as s3,
        FaultProxy(s3.endpoint_url, seed=args.seed) as proxy,
        tempfile.TemporaryDirectory() as tmp,
    ):
        s3.create_bucket(BUCKET)
        config = {
            "endpoint": proxy.url,
            "s3_endpoint": s3.endpoint_url,
            "catalog_url": f"sqlite:///{tmp}/catalog.db",
            "mib": args.mib,
            "tensors": args.tensors,
            "saves": args.saves,
            "outage_s": args.outage_s,
            "tmp": tmp,
            "tag": uuid.uuid4().hex[:8],
        }
        results = [rate_case(proxy, config, rate) for rate in [0.0, *rates]]
        loads.append(os.getloadavg()[0])
        outage = outage_case(proxy, config, f"s3://{BUCKET}/ckpt") if args.outage_s else None
        loads.append(os.getloadavg()[0])

    print(
        f"{dt.date.today()}: moto S3 on 127.0.0.1 behind a fault-injecting proxy (seed "
        f"{args.seed}), SQLite catalog; {args.mib:g} MiB in {args.tensors} tensors; "
        f"{args.saves} saves per rate; load average {' -> '.join(f'{x:.2f}' for x in loads)}"
    )
    clean = statistics.median(results[0]["times"]) if results[0]["times"] else float("nan")
    rows = []
    for result in results:
        median = statistics.median(result["times"]) if result["times"] else float("nan")
        rows.append(
            (
                f"{result['rate']:.0%}",
                f"{result['ok']}/{args.saves}",
                f"{result['injected']}/{result['requests']}",
                f"{median:.3f}",
                f"{median - clean:+.3f}",
                f"{median / clean:.2f}x",
                {True: "yes", False: "NO", None: "-"}[result["exact"]],
            )
        )
    headers = (
        "faults",
        "saves ok",
        "faults/requests",
        "median save (s)",
        "extra per save (s)",
        "vs fault-free",
        "load exact",
    )
    print(table(rows, headers))
    for result in results:
        for failure in result["failures"]:
            print(f"  {result['rate']:.0%}: {failure}")
    if outage is not None:
        reached = outage["reached"]
        clean_upload = outage["clean_upload"]
        print(
            f"outage of {outage['outage_s']:g} s with steps {outage['saved_during']} saved during "
            f"it: save_dir holds {outage['on_save_dir']}; every retained step there "
            + (
                f"{reached:.2f} s after recovery = {reached / clean_upload:.1f}x one fault-free "
                f"save+upload ({clean_upload:.2f} s)"
                if reached is not None
                else "NEVER (within the benchmark's deadline)"
            )
        )
        for error in outage["errors"]:
            print(f"  wait(): {error}")


if __name__ == "__main__":
    main()
