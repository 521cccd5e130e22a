"""Chaos for deduplicated saves: ``--kills`` SIGKILLs of saving jobs and gc processes, at random
(seeded) moments and at the kill points of tests/zephon/dedup/chaos_kills.py, with the
invariants checked on storage after every kill (tests/zephon/dedup/chaos.py):

    python benchmarks/dedup_chaos.py --backend s3 --kills 100
    python benchmarks/dedup_chaos.py --backend local --kills 100 --grace 0

Prints one line per round, then the table: rounds, kills of the job and of gc by kill point,
violations (must be 0), and what a final gc pass with grace 0 leaves unreferenced. Exits 1 on
a violation (the round that found it is the last one played, its details printed).

Measured on a shared 2-CPU machine (seed 0, num_to_keep 2, two gc processes):

- ``--grace 10`` (above any save here): 100 kills, 0 violations, on S3 (moto; 60 of the job, 40
  of gc, 10.7 min) and on local disk (56 and 44, 8.9 min); 0 bytes left unreferenced after the
  final gc.
- ``--grace 0``: before the fix, a violation on local disk in round 1 and on S3 in round 91: a
  gc sweep removed a chunk that a save in flight had uploaded, and the save then committed a
  checkpoint that names it. The sweep now spares the saves of the catalog's live rows
  (tests/zephon/dedup/test_chaos_dedup.py holds the deterministic reproduction).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid

from _common import servers, table  # noqa: F401  (puts the repo on sys.path)

from tests.zephon.dedup.chaos import ChaosConfig, Round, run_chaos, summary_rows


def progress(r: Round) -> None:
    kill = r.how if r.killed else f"no kill ({r.plan} not reached)"
    tail = f" VIOLATIONS: {r.violations}" if r.violations else ""
    errors = f" errors: {r.errors}" if r.errors else ""
    print(
        f"round {r.index:3d}  {r.victim:5s} {kill:28s} resumed {r.resumed} saved {r.saved} "
        f"lineage {r.lineage} latest {r.latest}  {r.seconds:.1f}s{tail}{errors}",
        flush=True,
    )


def campaign(args: argparse.Namespace, url: str, options: dict, workdir: str) -> int:
    config = ChaosConfig(
        url=url,
        storage_options=options,
        workdir=workdir,
        kills=args.kills,
        seed=args.seed,
        num_to_keep=args.num_to_keep,
        gc_processes=args.gc_processes,
        grace_s=args.grace,
        pending_grace_s=args.pending_grace,
    )
    started = time.monotonic()
    result = run_chaos(config, progress)
    minutes = (time.monotonic() - started) / 60
    rows = summary_rows(result)
    total = (
        "all",
        "",
        len(result.rounds),
        sum(r[3] for r in rows),
        len(result.violations),
    )
    print()
    print(
        f"backend {args.backend}, seed {args.seed}, num_to_keep {args.num_to_keep}, "
        f"{args.gc_processes} gc processes with grace {args.grace:g}s, {minutes:.1f} min"
    )
    print(table([*rows, total], ("killed", "at", "rounds", "kills", "violations")))
    kills = result.kills
    print(
        f"\nkills: {kills['saver']} of the job, {kills['gc']} of gc; "
        f"violations: {len(result.violations)}; process errors (no kill): {len(result.errors)}"
    )
    print(
        f"after a final gc with grace 0: {result.unreferenced_chunks} unreferenced chunk "
        f"instances ({result.unreferenced_chunk_bytes} bytes), "
        f"{result.uncommitted_payload_bytes} bytes of uncommitted payload; "
        f"{result.stored_bytes} bytes stored under the run"
    )
    for line in result.violations:
        print(f"VIOLATION {line}")
    for line in result.errors:
        print(f"error {line}")
    return 1 if result.violations else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("local", "s3"), default="s3")
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-to-keep", type=int, default=2)
    parser.add_argument("--gc-processes", type=int, default=2)
    parser.add_argument("--grace", type=float, default=0.0, help="gc grace, seconds")
    parser.add_argument("--pending-grace", type=float, default=5.0, help="seconds")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="dedup-chaos-")
    try:
        if args.backend == "local":
            return campaign(args, os.path.join(workdir, "ckpt"), {}, workdir)
        with servers.s3_server() as server:
            bucket = f"chaos-{uuid.uuid4().hex[:8]}"
            server.create_bucket(bucket)
            return campaign(args, f"s3://{bucket}/ckpt", server.storage_options(), workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
