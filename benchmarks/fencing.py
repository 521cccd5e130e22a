"""What fencing costs a save: the one save path (``zephon.saving.Save``: fenced catalog row,
fenced storage begin, re-check of the fence before the marker, fenced commit) against the same
save unfenced (a run that never had an attempt: epoch-0 catalog row, unfenced storage begin and
commit), back to back in each repeat.

    python benchmarks/fencing.py [--local-mib 256] [--s3-mib 64] [--small-kib 64] [--repeats 7]

Reported per case: median seconds of each and the median per-repeat difference (end to end,
which on a shared machine is mostly noise at these sizes); the time of the fence's own work,
one re-check of the run's attempt records per save, just before the marker (median of many,
as a percentage of the save: goal <= 2%); and on S3 the requests each save sends, and how many
are the fence's (local moto hides the latency a real, far-away S3 adds per sequential round
trip). The catalog is a
SQLite file on local disk; its fenced transitions take the same statements as unfenced ones
(the epoch comparison is part of each guarded update).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import uuid

from _common import count_s3_requests, servers, table, timed

from zephon.attempts import register
from zephon.catalog import Catalog  # noqa: E402 - _common puts the repo on sys.path
from zephon.locations import RunLocation
from zephon.saving import Save, manifest_facts
from zephon.storage import CheckpointStore

FILES = 8


def payload(total_bytes: int) -> dict[str, bytes]:
    size = max(total_bytes // FILES, 1)
    block = os.urandom(size)
    return {f"shard-{i}.bin": bytes([i]) + block[1:] for i in range(FILES)}


class Case:
    """Two runs in one store and one catalog: ``fenced`` has an attempt, ``plain`` never."""

    def __init__(self, url: str, options: dict, catalog: Catalog) -> None:
        self.store = CheckpointStore(url, options)
        self.catalog = catalog
        tag = uuid.uuid4().hex[:6]
        self.fenced_run, self.plain_run = f"fenced-{tag}", f"plain-{tag}"
        for run in (self.fenced_run, self.plain_run):
            catalog.ensure_run(run, self.store.location.canonical_url)
        location = RunLocation(self.fenced_run, self.store, self.fenced_run)
        self.attempt = register(
            location, catalog, lineage=self.store.run(self.fenced_run).lineage(), resumed_from=None
        )
        self.step = 0

    def fenced(self, files: dict[str, bytes]) -> None:
        self.step += 1
        with Save.begin(self.attempt, self.step, catalog=self.catalog) as writer:
            writer.write_many(files)
            writer.commit()

    def plain(self, files: dict[str, bytes]) -> None:
        self.step += 1
        run, step, store, catalog = self.plain_run, self.step, self.store, self.catalog
        row = catalog.begin_checkpoint(run, step, store.run(run).checkpoint_url(step))
        with store.run(run).begin(step, save_id=row.save_id) as writer:
            writer.write_many(files)
            manifest = writer.commit()
        catalog.mark_committed(run, step, row.save_id, **manifest_facts(manifest))


def measure(case: Case, files: dict[str, bytes], repeats: int) -> tuple[float, float, float]:
    """Median unfenced and fenced seconds, and the median per-repeat extra (fenced/plain - 1),
    alternating which goes first so drift on a shared machine hits both alike."""
    plain_t, fenced_t, extra = [], [], []
    for i in range(repeats):
        if i % 2:
            f = timed(lambda: case.fenced(files))
            p = timed(lambda: case.plain(files))
        else:
            p = timed(lambda: case.plain(files))
            f = timed(lambda: case.fenced(files))
        plain_t.append(p)
        fenced_t.append(f)
        extra.append(f / p - 1)
    return statistics.median(plain_t), statistics.median(fenced_t), statistics.median(extra)


def fence_seconds(case: Case, samples: int = 50) -> float:
    """The fence's own storage work in one save with a catalog: one re-check of the attempt
    records before the marker (the catalog's fenced begin checks the epoch in its own
    transaction, so storage's begin skips its check; without a catalog it makes it too)."""
    times = []
    for _ in range(samples):
        times.append(timed(lambda: case.store.run(case.fenced_run).check_fence(case.attempt.fence)))
    return statistics.median(times)


def row(label: str, plain: float, fenced: float, extra: float, fence: float, requests="") -> tuple:
    return (
        label,
        f"{plain:.3f}",
        f"{fenced:.3f}",
        f"{100 * extra:+.1f}%",
        f"{1000 * fence:.2f} ms = {100 * fence / plain:.2f}%",
        requests,
    )


class count_attempt_listings(count_s3_requests):  # noqa: N801 - a context manager
    """Also count the listings of ``_attempts/`` (the fence's requests)."""

    def __init__(self, fs) -> None:
        super().__init__(fs)
        self.fence = 0

    def on_call(self, model, params) -> None:
        super().on_call(model, params)
        query = params.get("query_string") or {}
        if model.name.startswith("ListObjects") and "_attempts" in str(query.get("prefix", "")):
            self.fence += 1


def requests_of(case: Case, fs, files: dict[str, bytes]) -> str:
    with count_attempt_listings(fs) as plain:
        case.plain(files)
    with count_attempt_listings(fs) as fenced:
        case.fenced(files)
    return (
        f"unfenced {plain.count} ({plain.fence} of them the fenced-run check), fenced "
        f"{fenced.count} ({fenced.fence} of them the fence)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local-mib", type=int, default=256)
    parser.add_argument("--s3-mib", type=int, default=64)
    parser.add_argument("--small-kib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="zephon-bench-fencing-")
    headers = (
        "case",
        "unfenced s",
        "fenced s",
        "end to end",
        "fence checks / save",
        "S3 requests per save",
    )
    rows = []
    try:
        with Catalog(f"sqlite:///{work}/catalog.db") as catalog:
            local = Case(os.path.join(work, "ckpt"), {}, catalog)
            for label, size in (
                (f"local, {args.local_mib} MiB in {FILES} files", args.local_mib << 20),
                (f"local, {args.small_kib} KiB in {FILES} files", args.small_kib << 10),
            ):
                files = payload(size)
                figures = measure(local, files, args.repeats)
                rows.append(row(label, *figures, fence_seconds(local)))
            with servers.s3_server() as s3:
                bucket = f"fencing-{uuid.uuid4().hex[:8]}"
                s3.create_bucket(bucket)
                remote = Case(f"s3://{bucket}/ckpt", s3.storage_options(), catalog)
                fs = remote.store.location.fs
                for label, size in (
                    (f"S3 via moto, {args.s3_mib} MiB in {FILES} files", args.s3_mib << 20),
                    (f"S3 via moto, {args.small_kib} KiB in {FILES} files", args.small_kib << 10),
                ):
                    files = payload(size)
                    figures = measure(remote, files, args.repeats)
                    fence = fence_seconds(remote)
                    rows.append(row(label, *figures, fence, requests_of(remote, fs, files)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows, headers))


if __name__ == "__main__":
    main()
