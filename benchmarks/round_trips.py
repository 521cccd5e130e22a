"""Sequential round trips per operation on S3, measured with added latency.

    python benchmarks/round_trips.py [--delay-ms 30] [--files 32] [--file-kib 2048]
                                     [--small-kib 4] [--many-files 128]
                                     [--tensors 200] [--repeats 3] [--no-two-ranks]

moto's S3 server runs on 127.0.0.1, where a request costs almost nothing; a far-away store
charges 20-100 ms for each request that waits for the one before. Each operation is timed
through two ``latency_proxy.LatencyProxy`` in front of the same moto server, one adding 0 ms
and one adding ``--delay-ms`` to every request, alternating per repeat so that the load of a
shared machine hits both alike. The extra time divided by the delay is the number of requests
on the critical path one after another: ``round trips = (t_delay - t_0) / delay``. The proxy
also counts the requests (the total, parallel ones included) and reports the *chain*: the
longest sequence of requests through the delaying proxy of which each went out only after the
one before was answered (``LatencyProxy.longest_chain``, median over the repeats). It counts
the same thing from the requests' order instead of from time, so it stays put when a shared
machine is busy, where the time difference swings by several round trips either way.

Operations:

- commit of N files: ``store.begin`` (fenced) + ``CheckpointWriter.commit(files=...)`` of
  ``--files`` files of ``--file-kib`` KiB (the uploads go out with the fence re-check); the
  same with files of ``--small-kib`` KiB, with ``--many-files`` of those, and with one file
  of ``--file-kib`` KiB; and the small-file case written by ``write_many`` before a plain
  ``commit()`` (which then lists the payload beside its fence re-check, one round trip more);
- ``begin`` alone (fenced; the writer aborted afterwards, untimed);
- a DCP save of ``--tensors`` small tensors through torch's ``dcp.save`` with
  ``zephon.dcp.Writer`` and a SQLite catalog (a warm-up save first registers the attempt),
  on one process and on two (gloo);
- its load: ``zephon.dcp.Reader`` at that step + ``dcp.load``;
- ``find_latest`` of the run through the catalog (storage requests counted), and
  ``store.latest`` without a catalog.

The DCP cases run in worker processes (gloo; rank 0 runs the proxies); the storage cases in
this one. Times are medians of ``--repeats``. The goals: commit of N files
<= 2 + ceil(N / 32) (32 uploads at once, on a pool with room for the checks beside them),
DCP save <= 4, load <= 2, latest through the catalog 0 storage requests, begin <= 1.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import math
import os
import statistics
import tempfile
import uuid
from collections.abc import Callable

from _common import join_group, parse_or_serve, run_ranks, servers, table, timed
from latency_proxy import LatencyProxy

BUCKET = "round-trips"
POOL = 32  # the uploads at once the commit goal assumes (storage's default)
#: the label suffix of the commit case that writes with write_many, then calls commit()
WRITE_MANY = ", write_many + commit()"

#: a case: (setup, fn, teardown) for one store endpoint, each called once per repeat
Case = tuple[Callable[[], object], Callable[[], object], Callable[[], object]]


def options_for(endpoint: str) -> dict:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


def s3_kind(line: str) -> str:
    """The kind of S3 request a request line is: LIST, GET, HEAD, PUT, DELETE, POST, ..."""
    method, _, target = line.partition(" ")
    query = target.partition("?")[2]
    if method == "GET" and "list-type=" in query:
        return "LIST"
    if method == "PUT" and "partNumber=" in query:
        return "UPLOAD-PART"
    if method == "POST" and "delete" in query.split("&"):
        return "DELETE-MANY"
    return method


def sample(proxy: LatencyProxy, seconds: float) -> dict:
    """One timed run: its seconds and the requests the proxy saw (in all, and per kind)."""
    kinds = collections.Counter(s3_kind(line) for line in proxy.request_lines)
    return {
        "t": seconds,
        "requests": proxy.requests,
        "chain": proxy.longest_chain,
        "methods": dict(kinds),
    }


def summarise(samples: list[dict]) -> dict:
    """The median time and request count of the samples of one operation at one delay."""
    return {
        "t": statistics.median(s["t"] for s in samples),
        "requests": int(statistics.median(s["requests"] for s in samples)),
        "chain": statistics.median(s["chain"] for s in samples),
        "methods": samples[-1]["methods"],
    }


def measure(proxies: list[LatencyProxy], cases: list[Case], repeats: int) -> list[dict]:
    """Per proxy, the summary of ``fn``'s runs, the proxies taking turns in each repeat."""
    samples: list[list[dict]] = [[] for _ in proxies]
    for _ in range(repeats):
        for i, (proxy, (setup, fn, teardown)) in enumerate(zip(proxies, cases, strict=True)):
            setup()
            proxy.reset()
            samples[i].append(sample(proxy, timed(fn)))
            teardown()
    return [summarise(s) for s in samples]


def make_files(count: int, kib: int) -> dict[str, bytes]:
    block = os.urandom(kib * 1024)
    return {f"shard-{i:02d}.bin": bytes([i % 256]) + block[1:] for i in range(count)}


# -- storage cases (this process) ----------------------------------------------------------------


def storage_cases(endpoint: str, payloads: dict[str, dict[str, bytes]]) -> dict[str, Case]:
    """The storage-level cases against one endpoint, each on a run of its own."""
    from zephon.storage import CheckpointStore

    store = CheckpointStore(f"s3://{BUCKET}/storage", options_for(endpoint))
    tag = uuid.uuid4().hex[:8]
    cases: dict[str, Case] = {}

    def fenced(run: str):
        fence = store.run(run).claim_attempt(after=store.run(run).lineage())
        return store.run(run).decide_resume(fence, resumed_from=None)

    def commit_case(run: str, payload: dict[str, bytes], last: bool) -> Case:
        fence = fenced(run)
        step = [0]

        def setup() -> None:
            step[0] += 1

        def fn() -> None:
            with store.run(run).begin(step[0], fence=fence) as writer:
                if last:  # the files go out with the commit's checks
                    writer.commit(files=payload)
                else:
                    writer.write_many(payload)
                    writer.commit()

        def teardown() -> None:  # keeps moto's memory small
            store.run(run).delete_many([step[0]])

        return setup, fn, teardown

    for i, (name, payload) in enumerate(payloads.items()):
        cases[name] = commit_case(f"commit{i}-{tag}", payload, WRITE_MANY not in name)

    run, fence, holder = f"begin-{tag}", fenced(f"begin-{tag}"), {}
    cases["begin"] = (
        lambda: None,
        lambda: holder.update(writer=store.run(run).begin(1, fence=fence)),
        lambda: holder.pop("writer").abort(),
    )
    return cases


# -- DCP cases (worker processes) ----------------------------------------------------------------


def worker(rank: int, world: int, port: int, config: dict) -> None:
    """One rank: DCP saves and loads through both proxies; rank 0 runs them and reports."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from zephon import dcp as zd
    from zephon.catalog import Catalog
    from zephon.latest import find_latest
    from zephon.locations import RunLocation
    from zephon.storage import CheckpointStore

    join_group(rank, world, port, timeout=600)
    delays = config["delays_ms"]
    proxies = [LatencyProxy(config["upstream"], d).start() for d in delays] if rank == 0 else []
    urls = [p.url for p in proxies]
    shared = [urls]
    dist.broadcast_object_list(shared, src=0)
    urls = shared[0]

    tensors = config["tensors"]
    state = {f"t{i:03d}": torch.full((16,), float(rank * 1000 + i)) for i in range(tensors)}
    if world > 1:  # each rank its own keys, as sharded training has
        state = {f"r{rank}.{k}": v for k, v in state.items()}
    # with the catalog (as the manager saves), and on one rank also without (storage alone)
    variants = (
        {"": config["catalog_url"]}
        if world > 1
        else {"": config["catalog_url"], ", no catalog": None}
    )
    runs = {v: [f"dcp{world}{v[2:4]}-{config['tag']}-{d:g}ms" for d in delays] for v in variants}
    run_urls = {v: [f"s3://{BUCKET}/dcp/{run}" for run in runs[v]] for v in variants}
    writers = {
        v: [
            zd.Writer(u, storage_options=options_for(e), catalog=catalog_url)
            for u, e in zip(run_urls[v], urls, strict=True)
        ]
        for v, catalog_url in variants.items()
    }
    step = [0]

    def save(v: str, i: int) -> None:
        checkpoint_id = f"{run_urls[v][i]}/save-{step[0]}"
        dcp.save(state, storage_writer=writers[v][i], checkpoint_id=checkpoint_id)

    def load(i: int) -> None:
        reader = zd.Reader(run_urls[""][i], step=step[0], storage_options=options_for(urls[i]))
        target = {k: torch.empty_like(v) for k, v in state.items()}
        dcp.load(target, storage_reader=reader)

    def timed_all(i: int, fn: Callable[[], None]) -> dict:
        dist.barrier()
        if rank == 0:
            proxies[i].reset()
        # the closing barrier is inside the timing: rank 0's time is the slowest rank's
        seconds = timed(lambda: (fn(), dist.barrier()))
        return sample(proxies[i], seconds) if rank == 0 else {}

    for v in variants:  # the first save registers the attempt: not what is measured
        for i in range(len(delays)):
            step[0] = 1
            save(v, i)
    results: dict[str, list[list[dict]]] = {}

    def record(name: str, i: int, one: dict) -> None:
        results.setdefault(name, [[] for _ in delays])[i].append(one)

    for repeat in range(config["repeats"]):
        step[0] = repeat + 2
        for v in variants:
            for i in range(len(delays)):
                record(f"DCP save{v}", i, timed_all(i, lambda v=v, i=i: save(v, i)))
        for i in range(len(delays)):
            record("DCP load", i, timed_all(i, lambda i=i: load(i)))

    if rank == 0 and world == 1:
        catalog = Catalog(config["catalog_url"])
        stores = [CheckpointStore(f"s3://{BUCKET}/dcp", options_for(e)) for e in urls]
        for _ in range(config["repeats"]):
            for i, run in enumerate(runs[""]):
                location = RunLocation(run, stores[i], run)
                proxies[i].reset()
                t = timed(lambda loc=location: find_latest(loc, catalog=catalog))
                record("latest, catalog", i, sample(proxies[i], t))
                proxies[i].reset()
                t = timed(lambda s=stores[i], r=run: s.run(r).latest())
                record("latest, no catalog", i, sample(proxies[i], t))
        catalog.close()
    for w in (w for per_variant in writers.values() for w in per_variant):
        w.close()
    dist.barrier()
    if rank == 0:
        out = {name: [summarise(s) for s in per_proxy] for name, per_proxy in results.items()}
        print("RESULT " + json.dumps(out), flush=True)
        for p in proxies:
            p.stop()
    dist.destroy_process_group()


def run_workers(world: int, config: dict) -> dict[str, list[dict]]:
    return run_ranks(__file__, world, config, "DCP")


# -- report --------------------------------------------------------------------------------------


def goal(name: str) -> str:
    """The goal for an operation, by its label."""
    if name.startswith("commit, "):
        n = int(name.split()[1])
        return f"<= {(3 if WRITE_MANY in name else 2) + math.ceil(n / POOL)}"
    if name.startswith("DCP save"):
        return "<= 4"
    if name.startswith("DCP load"):
        return "<= 2"
    return {"begin": "<= 1", "latest, catalog": "0 requests"}.get(name, "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=30.0)
    parser.add_argument("--files", type=int, default=32)
    parser.add_argument("--file-kib", type=int, default=2048)
    parser.add_argument("--small-kib", type=int, default=4, help="the commit again, small files")
    parser.add_argument(
        "--many-files", type=int, default=128, help="the small-file commit again, this many files"
    )
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-two-ranks", action="store_true", help="skip the 2-process DCP case")
    args = parse_or_serve(parser, worker)
    if args is None:
        return

    delays = [0.0, args.delay_ms]
    payloads = {
        f"commit, {n} x {kib} KiB": make_files(n, kib)
        for n, kib in (
            (args.files, args.file_kib),
            (args.files, args.small_kib),
            (args.many_files, args.small_kib),
            (1, args.file_kib),
        )
    }
    payloads[f"commit, {args.files} x {args.small_kib} KiB{WRITE_MANY}"] = make_files(
        args.files, args.small_kib
    )
    rows: list[tuple] = []
    methods: list[str] = []

    def add(name: str, pair: list[dict]) -> None:
        t0, t1 = pair[0]["t"], pair[1]["t"]
        trips = (t1 - t0) / (args.delay_ms / 1000)
        requests = "/".join(str(p["requests"]) for p in pair)
        chain = f"{pair[1]['chain']:g}"
        rows.append((name, requests, f"{t0:.3f}", f"{t1:.3f}", f"{trips:.1f}", chain, goal(name)))
        by_method = ", ".join(f"{m} {n}" for m, n in sorted(pair[1]["methods"].items()))
        methods.append(f"  {name}: {by_method}")

    with servers.s3_server() as s3, tempfile.TemporaryDirectory() as tmp:
        s3.create_bucket(BUCKET)
        with (
            LatencyProxy(s3.endpoint_url, 0) as fast,
            LatencyProxy(s3.endpoint_url, args.delay_ms) as slow,
        ):
            proxies = [fast, slow]
            per_endpoint = [storage_cases(p.url, payloads) for p in proxies]
            for name in per_endpoint[0]:
                add(name, measure(proxies, [c[name] for c in per_endpoint], args.repeats))
        config = {
            "upstream": s3.endpoint_url,
            "delays_ms": delays,
            "tensors": args.tensors,
            "repeats": args.repeats,
            "catalog_url": f"sqlite:///{tmp}/catalog.db",
            "tag": uuid.uuid4().hex[:8],
        }
        for world in (1,) if args.no_two_ranks else (1, 2):
            for name, pair in run_workers(world, config).items():
                label = f"{name} ({world} rank{'s' if world > 1 else ''})"
                add(label if name.startswith("DCP") else name, pair)

    print(
        f"{dt.date.today()}: moto S3 on 127.0.0.1 behind a proxy adding 0 or "
        f"{args.delay_ms:g} ms per request; DCP "
        f"{args.tensors} tensors of 16 floats per rank; median of {args.repeats}"
    )
    headers = (
        "operation",
        f"requests (0/{args.delay_ms:g} ms)",
        "t at 0 ms (s)",
        f"t at {args.delay_ms:g} ms (s)",
        "round trips",
        "chain",
        "goal",
    )
    print(table(rows, headers))
    print(f"requests by kind at {args.delay_ms:g} ms (the last repeat):")
    print("\n".join(methods))


if __name__ == "__main__":
    main()
