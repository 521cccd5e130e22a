"""Storage benchmark: Zephon's commit against plain writes of the same bytes, and the scan.

    python benchmarks/storage_throughput.py [--local-mib 1024] [--s3-mib 256] [--steps 1000]

(a) local disk: commit of N MiB in 32 files (parallel writes, CRC32C, fsync, marker) vs plain
    Python writes + fsync of the same files, one after another. Goal: ratio >= 0.9.
(b) S3 (moto's server on 127.0.0.1): commit vs plain ``s3fs.put`` of the same local files.
    Goal: ratio >= 0.9.
(c) scan of a run with 1,000 committed checkpoints on S3: requests and time of
    ``committed_steps`` (one paged listing) vs the naive delimited listing + one HEAD per step.
(d) one object of ``--object-mib`` MiB (256) put and read back on moto: the backend's
    ``put_buffer`` / ``read_range_into`` through the native client (obstore) against the same
    calls through s3fs (``native=False``), and the AWS CRT client that s3torchconnector uses
    (when ``s3torchconnectorclient`` is installed): time, and this process's CPU seconds per
    GiB (getrusage; moto runs in its own process). Ratios are s3fs / candidate.
(e) warm local load: ``zephon.dcp.load`` of ``--load-mib`` MiB of tensors from local disk (in
    the page cache) into preallocated tensors, every slice's CRC32C checked, against a plain
    read of the same shard files into preallocated memory (``readinto``, one file after
    another). Goal: ratio (plain / Zephon) >= 0.8.
Ratios are baseline time / Zephon time (the median over repeats that run the two back to back):
above 1 means Zephon is faster.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from _common import count_s3_requests, interleaved, servers, table, timed

from zephon.storage import CheckpointStore  # noqa: E402 - _common puts the repo on sys.path

FILES = 32


def make_files(directory: str, total_mib: int) -> dict[str, str]:
    size = total_mib * (1 << 20) // FILES
    block = os.urandom(min(size, 8 << 20))
    paths = {}
    for i in range(FILES):
        path = os.path.join(directory, f"shard-{i:02d}.bin")
        with open(path, "wb") as out:
            written = 0
            while written < size:
                piece = block[: size - written]
                out.write(bytes([i]) + piece[1:])
                written += len(piece)
        paths[f"shard-{i:02d}.bin"] = path
    return paths


def bench_local(total_mib: int, repeats: int) -> list[tuple]:
    src = tempfile.mkdtemp(prefix="zephon-bench-src-")
    dst = tempfile.mkdtemp(prefix="zephon-bench-dst-")
    try:
        files = make_files(src, total_mib)
        payload = {}
        for name, path in files.items():
            with open(path, "rb") as handle:
                payload[name] = handle.read()

        def plain():
            target = os.path.join(dst, "plain")
            os.makedirs(target, exist_ok=True)
            for name, data in payload.items():
                with open(os.path.join(target, name), "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
            fd = os.open(target, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        store = CheckpointStore(os.path.join(dst, "zephon"))
        step = iter(range(10**6))

        def zephon():
            with store.run("bench").begin(next(step)) as writer:
                writer.write_many(payload)
                writer.commit()

        def clean():
            shutil.rmtree(dst, ignore_errors=True)
            os.makedirs(dst)

        base_med, zep_med, ratio = interleaved(repeats, plain, zephon, clean)
        mib = total_mib
        return [
            ("local: plain write+fsync (baseline)", f"{base_med:.2f}", f"{mib / base_med:.0f}", ""),
            ("local: Zephon commit", f"{zep_med:.2f}", f"{mib / zep_med:.0f}", f"{ratio:.2f}"),
        ]
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)


def bench_s3(s3: servers.S3Server, total_mib: int, repeats: int) -> list[tuple]:
    import s3fs

    src = tempfile.mkdtemp(prefix="zephon-bench-src-")
    try:
        files = make_files(src, total_mib)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(bucket)
        counter = iter(range(10**6))

        def plain():
            prefix = f"{bucket}/plain/{next(counter)}"
            fs.put(list(files.values()), prefix + "/")

        store = CheckpointStore(f"s3://{bucket}/zephon", s3.storage_options())

        def zephon():
            with store.run("bench").begin(next(counter)) as writer:
                writer.write_many(files)
                writer.commit()

        base_med, zep_med, ratio = interleaved(repeats, plain, zephon)
        mib = total_mib
        return [
            ("s3: s3fs.put (baseline)", f"{base_med:.2f}", f"{mib / base_med:.0f}", ""),
            ("s3: Zephon commit", f"{zep_med:.2f}", f"{mib / zep_med:.0f}", f"{ratio:.2f}"),
        ]
    finally:
        shutil.rmtree(src, ignore_errors=True)


def bench_scan(s3: servers.S3Server, steps: int) -> list[tuple]:
    bucket = f"scan-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(bucket)
    store = CheckpointStore(f"s3://{bucket}/ckpt", s3.storage_options())

    def save(step: int) -> None:
        with store.run("run").begin(step) as writer:
            writer.write_bytes("state.json", b"{}")
            writer.commit()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(save, range(steps)))
    fs = store.location.fs

    with count_s3_requests(fs) as zephon_requests:
        zephon_time = timed(lambda: store.run("run").committed_steps())
    found = store.run("run").committed_steps()
    assert len(found) == steps, len(found)

    def naive():
        dirs = fs.ls(f"{bucket}/ckpt/run", refresh=True)
        return [d for d in dirs if fs.exists(f"{d}/_COMMIT")]

    with count_s3_requests(fs) as naive_requests:
        naive_time = timed(naive)
    with count_s3_requests(fs) as latest_requests:
        latest_time = timed(lambda: store.run("run").latest_step())
    return [
        (
            f"scan {steps} steps: list + HEAD per step (baseline)",
            f"{naive_time:.2f}",
            naive_requests.count,
            "",
        ),
        (
            f"scan {steps} steps: Zephon committed_steps",
            f"{zephon_time:.2f}",
            zephon_requests.count,
            f"{naive_time / zephon_time:.1f}",
        ),
        (
            f"latest of {steps} steps: Zephon latest_step",
            f"{latest_time:.2f}",
            latest_requests.count,
            f"{naive_time / latest_time:.1f}",
        ),
    ]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed_cpu(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (all threads) of one call."""
    cpu, wall = _cpu_s(), time.perf_counter()
    fn()
    return time.perf_counter() - wall, _cpu_s() - cpu


def _crt_client(s3: servers.S3Server):
    """The AWS CRT client s3torchconnector uses, on moto; None if it is not installed."""
    try:
        from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client
    except ImportError:
        return None
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    return MountpointS3Client("us-east-1", endpoint=s3.endpoint_url, force_path_style=True)


def bench_object(s3: servers.S3Server, mib: int, repeats: int) -> list[tuple]:
    """(d): one object of ``mib`` MiB put and read back, per client, interleaved."""
    bucket = f"object-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(bucket)
    data = memoryview(bytearray(os.urandom(mib << 20)))
    into = memoryview(bytearray(mib << 20))
    part = 16 << 20
    stores = {
        "s3fs": CheckpointStore(f"s3://{bucket}/f", {**s3.storage_options(), "native": False}),
        "obstore": CheckpointStore(f"s3://{bucket}/n", s3.storage_options()),
    }
    assert stores["obstore"].location.backend.native is not None
    assert stores["s3fs"].location.backend.native is None
    sides: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    for name, store in stores.items():
        backend, path = store.location.backend, f"{store.location.root}/obj"

        def put(backend=backend, path=path) -> None:
            backend.put_buffer(path, data, part)

        def get(backend=backend, path=path) -> None:
            assert backend.read_range_into(path, 0, into) == into.nbytes

        sides[name] = (put, get)
    crt = _crt_client(s3)
    if crt is not None:

        def crt_put() -> None:
            stream = crt.put_object(bucket, "crt/obj")
            for start in range(0, data.nbytes, part):  # its binding takes bytes only
                stream.write(data[start : start + part].tobytes())
            stream.close()

        def crt_get() -> None:
            got = 0
            for chunk in crt.get_object(bucket, "crt/obj"):
                into[got : got + len(chunk)] = chunk
                got += len(chunk)
            assert got == into.nbytes

        sides["AWS CRT"] = (crt_put, crt_get)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    names = list(sides)
    for repeat in range(repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        for op, index in (("put", 0), ("get", 1)):
            for name in order:
                times.setdefault((name, op), []).append(_timed_cpu(sides[name][index]))
    rows = []
    gib = mib / 1024
    for op in ("put", "get"):
        base = [w for w, _ in times[("s3fs", op)]]
        base_cpu = statistics.median(c for _, c in times[("s3fs", op)])
        for name in names:
            walls = [w for w, _ in times[(name, op)]]
            cpu = statistics.median(c for _, c in times[(name, op)])
            ratio = statistics.median(b / w for b, w in zip(base, walls, strict=True))
            rows.append(
                (
                    f"{op} {mib} MiB: {name}",
                    f"{statistics.median(walls):.2f}",
                    f"{cpu / gib:.2f}",
                    f"{ratio:.2f}" if name != "s3fs" else "",
                    f"{base_cpu / cpu:.2f}" if name != "s3fs" else "",
                )
            )
    for store in stores.values():
        store.close()
    return rows


def bench_warm_load(total_mib: int, repeats: int) -> list[tuple]:
    """(e): Zephon's DCP load from the page cache against plain reads of the same files."""
    import torch
    from save_restore_speed import PlainRead

    from zephon import dcp as zd
    from zephon.dcp.reader import THREAD_COUNT

    base = tempfile.mkdtemp(prefix="zephon-bench-load-")
    try:
        store = CheckpointStore(os.path.join(base, "ckpt"))
        count = 64
        numel = (total_mib << 20) // 4 // count
        state = {f"layer{i}.weight": torch.randn(numel) for i in range(count)}
        target = {name: torch.empty_like(t) for name, t in state.items()}
        writer = zd.attach_ranks(store, "bench", 1, store.run("bench").begin(1))
        zd.save(state, zd.ZephonStorageWriter(writer, thread_count=4))
        reader = store.run("bench").reader(1)
        files = [os.path.join(reader.path, name) for name in reader.names]
        # The baseline the issue means: the same files read whole into memory allocated (and
        # touched) beforehand, on as many threads as Zephon's reader uses
        plain = PlainRead(files, THREAD_COUNT)

        def zephon(verify: bool = True) -> None:
            zd.load(target, zd.ZephonStorageReader(store, "bench", 1, verify=verify))

        plain(), zephon()  # into the page cache
        base_med, zep_med, ratio = interleaved(repeats, plain, zephon)
        for name, tensor in state.items():
            assert torch.equal(tensor, target[name]), name
        _, raw_med, raw_ratio = interleaved(repeats, plain, lambda: zephon(verify=False))
        plain.close()
        mib = sum(b.numel() for b in plain.buffers) / (1 << 20)
        return [
            (
                f"warm: plain readinto of the files, {THREAD_COUNT} threads (baseline)",
                f"{base_med:.3f}",
                f"{mib / base_med:.0f}",
                "",
            ),
            (
                "warm: Zephon DCP load (CRC32C checked)",
                f"{zep_med:.3f}",
                f"{mib / zep_med:.0f}",
                f"{ratio:.2f}",
            ),
            (
                "warm: Zephon DCP load, verify=False (for reference)",
                f"{raw_med:.3f}",
                f"{mib / raw_med:.0f}",
                f"{raw_ratio:.2f}",
            ),
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local-mib", type=int, default=1024)
    parser.add_argument("--s3-mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--object-mib", type=int, default=256)
    parser.add_argument("--load-mib", type=int, default=1024)
    parser.add_argument(
        "--only", default="a,b,c,d,e", help="comma-separated sections to run (default: all)"
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    if "e" in only:
        rows = bench_warm_load(args.load_mib, args.repeats)
        print(
            table(rows, (f"(e) warm local load, {args.load_mib} MiB", "median s", "MiB/s", "ratio"))
        )
        print()
    if "d" in only:
        with servers.s3_server() as s3:
            rows = bench_object(s3, args.object_mib, args.repeats)
        print(
            table(
                rows,
                (
                    "(d) one object on moto",
                    "median s",
                    "client CPU-s/GiB",
                    "time ratio vs s3fs",
                    "CPU ratio vs s3fs",
                ),
            )
        )
        print()
    if not only & {"a", "b", "c"}:
        return

    rows = bench_local(args.local_mib, args.repeats)
    print(
        table(
            rows,
            (
                "(a) local, " + f"{args.local_mib} MiB in {FILES} files",
                "median s",
                "MiB/s",
                "ratio vs baseline",
            ),
        )
    )
    print()
    with servers.s3_server() as s3:
        rows = bench_s3(s3, args.s3_mib, args.repeats)
        print(
            table(
                rows,
                (
                    f"(b) S3 via moto, {args.s3_mib} MiB in {FILES} files",
                    "median s",
                    "MiB/s",
                    "ratio vs baseline",
                ),
            )
        )
        print()
        rows = bench_scan(s3, args.steps)
        print(
            table(rows, ("(c) scan on S3 via moto", "seconds", "requests", "speed-up vs baseline"))
        )


if __name__ == "__main__":
    main()
