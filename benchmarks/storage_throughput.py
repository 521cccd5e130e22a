"""Storage benchmark: Zephon's commit against plain writes of the same bytes, and the scan.

    python benchmarks/storage_throughput.py [--local-mib 1024] [--s3-mib 256] [--steps 1000]

(a) local disk: commit of N MiB in 32 files (parallel writes, CRC32C, fsync, marker) vs plain
    Python writes + fsync of the same files, one after another. Goal: ratio >= 0.9.
(b) S3 (moto's server on 127.0.0.1): commit vs plain ``s3fs.put`` of the same local files.
    Goal: ratio >= 0.9.
(c) scan of a run with 1,000 committed checkpoints on S3: requests and time of
    ``committed_steps`` (one paged listing) vs the naive delimited listing + one HEAD per step.
Ratios are baseline time / Zephon time (the median over repeats that run the two back to back):
above 1 means Zephon is faster.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import uuid
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local-mib", type=int, default=1024)
    parser.add_argument("--s3-mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

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
