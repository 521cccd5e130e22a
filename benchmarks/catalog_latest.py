"""Latest-checkpoint lookup through the catalog, at scale, on SQLite and PostgreSQL.

    python benchmarks/catalog_latest.py                 # 1,000 runs x 1,000 checkpoints
    python benchmarks/catalog_latest.py --quick         # 100 x 100, a few seconds
    python benchmarks/catalog_latest.py --runs 200 --per-run 5000 --lookups 5000
    python benchmarks/catalog_latest.py --sections events --events 10000000

For each backend: create a catalog (Alembic, as ``Catalog(url)`` does), bulk-load
``runs x per_run`` checkpoint rows (executemany on SQLite, COPY on PostgreSQL), ANALYZE, then time
``Catalog.latest_committed(run)`` for random runs: p50/p99 over ``--lookups`` calls, after a
warm-up. Goal (issue 3): p50 <= 5 ms with 1M rows.

The ``events`` section adds ``--events`` audit events (default 10M) beside the 1M checkpoint
rows, bulk-loaded in SQL (a recursive CTE on SQLite, ``generate_series`` on PostgreSQL) with
the two events indexes built afterwards, as a restore would; it times ``latest_committed``
again, then ``Catalog.prune_events`` deleting the older half of the log, with the time of each
batch (each batch is one transaction, so the longest one is what other writers may wait).

PostgreSQL: ``ZEPHON_TEST_POSTGRES_URL`` or postgresql+psycopg://postgres@127.0.0.1:5432/test
names the server; the benchmark works in a throwaway database ``zephon_bench_<random>`` that
it drops at the end, and never touches anything else there.

Layout: each section is a function ``section_*(args, results) -> list[Row]``, listed in
``SECTIONS``; ``main()`` runs them in order and prints one table. ``results`` holds earlier
sections' rows, so a later section (e.g. a storage scan) can print its ratio to the catalog.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common

from zephon.catalog import Catalog  # noqa: E402
from zephon.catalog.catalog import PRUNE_BATCH  # noqa: E402
from zephon.catalog.models import Run  # noqa: E402

POSTGRES_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
GOAL_P50_MS = 5.0


@dataclass
class Row:
    """One line of the result table; ``figures`` are printed as ``name=value`` pairs."""

    section: str
    backend: str
    size: str
    p50_ms: float | None = None
    p99_ms: float | None = None
    figures: dict[str, str] = field(default_factory=dict)


# -- databases ---------------------------------------------------------------------------------


@contextlib.contextmanager
def sqlite_database() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as directory:
        yield f"sqlite:///{directory}/catalog.db"


def postgres_database() -> contextlib.AbstractContextManager[str]:
    """A throwaway database on the benchmark server; dropped however the benchmark ends."""
    from _common import servers

    return servers.postgres_database(servers.postgres_url(), prefix="zephon_bench")


BACKENDS: dict[str, Callable[[], contextlib.AbstractContextManager[str]]] = {
    "sqlite": sqlite_database,
    "postgresql": postgres_database,
}


# -- loading -----------------------------------------------------------------------------------


def _state(step: int, per_run: int) -> str:
    # A run that has been saving for a while: the newest step is still being written, old
    # ones were mostly deleted by retention, and a share of committed rows sits among them.
    if step == per_run - 1:
        return "pending"
    return "deleted" if step % 4 == 3 else "committed"


def _checkpoint_rows(run_ids: list[int], per_run: int) -> Iterator[tuple]:
    base = datetime(2026, 1, 1, tzinfo=UTC)
    for run_id in run_ids:
        for step in range(per_run):
            at = base + timedelta(seconds=step)
            state = _state(step, per_run)
            committed = at if state != "pending" else None
            yield (
                run_id,
                step,
                state,
                f"s3://bench/r{run_id}/save-{step}",
                "bench",
                state != "pending" and step * 1000 or None,
                False,
                at,
                committed,
                at,
            )


_COLUMNS = (
    "run_id",
    "step",
    "state",
    "path",
    "save_id",
    "bytes",
    "pinned",
    "created_at",
    "committed_at",
    "updated_at",
)


def _load_sqlite(url: str, run_ids: list[int], per_run: int) -> None:
    import sqlite3

    def stamp(value: datetime | None) -> str | None:
        # The text form UtcDateTime stores on SQLite: naive UTC with microseconds.
        return None if value is None else value.replace(tzinfo=None).isoformat(" ", "microseconds")

    connection = sqlite3.connect(make_url(url).database, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.executemany(
            f"INSERT INTO checkpoints ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * 10)})",
            (
                (*row[:7], stamp(row[7]), stamp(row[8]), stamp(row[9]))
                for row in _checkpoint_rows(run_ids, per_run)
            ),
        )
        connection.execute("COMMIT")
        connection.execute("ANALYZE")
    finally:
        connection.close()


def _load_postgres(url: str, run_ids: list[int], per_run: int) -> None:
    import psycopg

    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn) as connection:
        with connection.cursor() as cursor:
            statement = f"COPY checkpoints ({', '.join(_COLUMNS)}) FROM STDIN"
            with cursor.copy(statement) as copy:
                for row in _checkpoint_rows(run_ids, per_run):
                    copy.write_row(row)
        connection.commit()
        connection.autocommit = True
        connection.execute("ANALYZE")
        _checkpoint(connection)


def _checkpoint(connection) -> None:
    """Flush the load to disk now, so that the checkpointer's writes do not land in the timed
    lookups (superuser or pg_checkpoint only; skipped otherwise)."""
    import psycopg

    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        connection.execute("CHECKPOINT")


def populate(url: str, runs: int, per_run: int) -> list[str]:
    """Create the schema through ``Catalog`` and bulk-load the rows; returns the run names."""
    Catalog(url).close()
    names = [f"run-{i:05d}" for i in range(runs)]
    now = datetime.now(UTC)
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(
                insert(Run),
                [
                    dict(
                        name=n,
                        storage_url=f"s3://bench/{n}",
                        kind="train",
                        status="active",
                        num_to_keep=2,
                        created_at=now,
                        updated_at=now,
                    )
                    for n in names
                ],
            )
            run_ids = list(connection.execute(text("SELECT id FROM runs ORDER BY id")).scalars())
    finally:
        engine.dispose()
    loader = _load_sqlite if url.startswith("sqlite") else _load_postgres
    loader(url, run_ids, per_run)
    return names


# -- timing ------------------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_latest(
    url: str, names: list[str], lookups: int, seed: int, expected_step: int
) -> list[float]:
    """Milliseconds per ``latest_committed`` call for random runs, after a warm-up."""
    chooser = random.Random(seed)
    samples = []
    with Catalog(url) as catalog:
        for name in chooser.choices(names, k=min(50, lookups)):
            catalog.latest_committed(name)
        for name in chooser.choices(names, k=lookups):
            start = time.perf_counter()
            latest = catalog.latest_committed(name)
            samples.append((time.perf_counter() - start) * 1000)
            assert latest is not None and latest.step == expected_step, (name, latest)
    return samples


# -- sections ----------------------------------------------------------------------------------


def section_catalog_latest(args: argparse.Namespace, results: list[Row]) -> list[Row]:
    rows = []
    for backend in args.backends:
        with BACKENDS[backend]() as url:
            start = time.perf_counter()
            names = populate(url, args.runs, args.per_run)
            build_s = time.perf_counter() - start
            expected = max(s for s in range(args.per_run) if _state(s, args.per_run) == "committed")
            samples = time_latest(url, names, args.lookups, args.seed, expected)
        p50, p99 = percentile(samples, 0.50), percentile(samples, 0.99)
        rows.append(
            Row(
                section="catalog latest_committed",
                backend=backend,
                size=f"{args.runs:,} runs x {args.per_run:,} = {args.runs * args.per_run:,} rows",
                p50_ms=p50,
                p99_ms=p99,
                figures={
                    "mean": f"{statistics.fmean(samples):.3f} ms",
                    "lookups": f"{len(samples):,}",
                    "load": f"{build_s:.1f} s",
                    "goal p50<=5ms": "met" if p50 <= GOAL_P50_MS else "MISSED",
                },
            )
        )
        print(f"  {backend}: p50 {p50:.3f} ms, p99 {p99:.3f} ms", file=sys.stderr)
    return rows


def _s3_store(server, name: str):
    from zephon.storage import CheckpointStore

    bucket = f"{name}-{uuid.uuid4().hex[:8]}"
    server.create_bucket(bucket)
    return CheckpointStore(f"s3://{bucket}/ckpt", server.storage_options())


def _plant_checkpoints(store, run: str, steps: range, files: int, size: int = 64) -> None:
    """Committed checkpoints written straight as objects (payload, then a real manifest as the
    marker), in concurrent batches: the commit path itself is measured by storage_throughput."""
    from zephon.storage.checksum import crc32c_of
    from zephon.storage.manifest import FileEntry, Manifest

    payload = b"x" * size
    entry_crc = crc32c_of(payload)
    objects: dict[str, bytes] = {}
    for step in steps:
        base = store.run(run).checkpoint_path(step)
        names = [f"part-{i:03d}.bin" for i in range(files)]
        save_id = uuid.uuid4().hex
        manifest = Manifest(
            run=run,
            step=step,
            save_id=save_id,
            files=tuple(FileEntry(n, size, entry_crc) for n in names),
            payload=save_id,  # each save's files in a directory of their own
        )
        objects.update({f"{base}/{save_id}/{n}": payload for n in names})
        objects[f"{base}/_COMMIT"] = manifest.to_json()
    fs = store.location.fs
    keys = list(objects)
    for start in range(0, len(keys), 2000):
        fs.pipe({k: objects[k] for k in keys[start : start + 2000]})


def section_storage_scan(args: argparse.Namespace, results: list[Row]) -> list[Row]:
    """The same question answered by listing S3 (moto): the latest of N checkpoints."""
    from _common import count_s3_requests, servers

    steps = args.scan_steps
    with servers.s3_server() as server:
        store = _s3_store(server, "scan")
        _plant_checkpoints(store, "run", range(steps), files=2)
        fs = store.location.fs
        times, requests = [], 0
        for _ in range(3):
            with count_s3_requests(fs) as counter:
                start = time.perf_counter()
                latest = store.run("run").latest_step()
                times.append((time.perf_counter() - start) * 1000)
            requests = counter.count
            assert latest == steps - 1, latest
    scan_ms = statistics.median(times)
    rows = [
        Row(
            section="storage scan latest_step",
            backend="s3 (moto)",
            size=f"{steps:,} checkpoints, {3 * steps:,} objects",
            p50_ms=scan_ms,
            figures={"requests": str(requests)},
        )
    ]
    for row in results:
        if row.section == "catalog latest_committed" and row.p50_ms:
            ratio = scan_ms / row.p50_ms
            rows[0].figures[f"{row.backend} faster"] = (
                f"{ratio:,.0f}x ({'met' if ratio >= 100 else 'MISSED'} goal 100x)"
            )
    return rows


def section_gc_requests(args: argparse.Namespace, results: list[Row]) -> list[Row]:
    """Storage requests ``zephon gc`` makes to delete 100 checkpoints of 100 files each."""
    from _common import count_s3_requests, servers

    from zephon.gc import collect_garbage
    from zephon.storage import CheckpointStore

    count, files = args.gc_checkpoints, args.gc_files
    with servers.s3_server() as server, sqlite_database() as url:
        store = _s3_store(server, "gc")
        _plant_checkpoints(store, "run", range(count + 1), files=files)
        with Catalog(url) as catalog:
            catalog.ensure_run("run", store.location.canonical_url, num_to_keep=1)
            from zephon.sync import sync_storage

            sync_storage(catalog, store.location.canonical_url, server.storage_options())
            # gc opens its own store from the catalog's storage URL: count on the filesystem
            # that store gets (fsspec hands out one instance per URL and options, defaults
            # such as the connection pool included)
            fs = CheckpointStore(store.location.canonical_url, server.storage_options()).location.fs
            with count_s3_requests(fs) as counter:
                start = time.perf_counter()
                report = collect_garbage(catalog, storage_options=server.storage_options())
                seconds = time.perf_counter() - start
        assert len(report.deleted) == count, report
        assert store.run("run").committed_steps() == [count]
    deletes = counter.by_operation.get("DeleteObjects", 0) + counter.by_operation.get(
        "DeleteObject", 0
    )
    naive = count * (files + 1)
    return [
        Row(
            section="gc delete requests",
            backend="s3 (moto)",
            size=f"{count} checkpoints x {files} files",
            figures={
                "delete requests": str(deletes),
                "all requests": str(counter.count),
                "one DELETE per object would be": str(naive),
                "by operation": " ".join(
                    f"{k}:{v}" for k, v in sorted(counter.by_operation.items())
                ),
                "time": f"{seconds:.1f} s",
            },
        )
    ]


# -- events at scale ---------------------------------------------------------------------------

_EVENTS_FROM = datetime(2025, 1, 1, tzinfo=UTC)
_EVENT_INDEXES = {
    "ix_events_at": "CREATE INDEX ix_events_at ON events (at)",
    "ix_events_run_name_at": "CREATE INDEX ix_events_run_name_at ON events (run_name, at)",
}


def _event_span(until: datetime) -> timedelta:
    return until - _EVENTS_FROM


def _load_events_sqlite(url: str, count: int, runs: int, until: datetime) -> dict[str, float]:
    """``count`` events evenly spread from 2025-01-01 to ``until``, in one INSERT ... SELECT."""
    import sqlite3

    timings = {}
    connection = sqlite3.connect(make_url(url).database, isolation_level=None)
    try:
        for name in _EVENT_INDEXES:
            connection.execute(f"DROP INDEX {name}")
        start = time.perf_counter()
        connection.execute("BEGIN IMMEDIATE")
        # The text form UtcDateTime stores: 'YYYY-MM-DD HH:MM:SS.ffffff' (strftime's %f has
        # milliseconds, so three zeros complete the fixed width).
        connection.execute(
            "WITH RECURSIVE seq(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM seq WHERE i < ?) "
            "INSERT INTO events (at, actor, action, run_name, step, detail) "
            "SELECT strftime('%Y-%m-%d %H:%M:%f', ? + i * ?) || '000', 'bench@host:1', "
            "CASE i % 4 WHEN 0 THEN 'begun' WHEN 1 THEN 'committed' WHEN 2 THEN 'claimed' "
            "ELSE 'deleted' END, printf('run-%05d', i % ?), i / ?, "
            '\'{"save_id": "bench", "epoch": 0}\' FROM seq',
            (
                count - 1,
                _julian(_EVENTS_FROM),
                _event_span(until).total_seconds() / 86400 / count,
                runs,
                runs,
            ),
        )
        connection.execute("COMMIT")
        timings["insert"] = time.perf_counter() - start
        for name, ddl in _EVENT_INDEXES.items():
            start = time.perf_counter()
            connection.execute(ddl)
            timings[name] = time.perf_counter() - start
        connection.execute("ANALYZE")
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        connection.close()
    return timings


def _julian(moment: datetime) -> float:
    return moment.timestamp() / 86400 + 2440587.5


def _load_events_postgres(url: str, count: int, runs: int, until: datetime) -> dict[str, float]:
    import psycopg

    timings = {}
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as connection:
        for name in _EVENT_INDEXES:
            connection.execute(f"DROP INDEX {name}")
        start = time.perf_counter()
        connection.execute(
            "INSERT INTO events (at, actor, action, run_name, step, detail) "
            "SELECT %s::timestamptz + i * %s::interval, 'bench@host:1', "
            "(ARRAY['begun', 'committed', 'claimed', 'deleted'])[mod(i, 4) + 1], "
            "'run-' || lpad(mod(i, %s)::text, 5, '0'), i / %s, "
            '\'{"save_id": "bench", "epoch": 0}\'::jsonb '
            "FROM generate_series(0, %s - 1) AS i",
            (_EVENTS_FROM, _event_span(until) / count, runs, runs, count),
        )
        timings["insert"] = time.perf_counter() - start
        for name, ddl in _EVENT_INDEXES.items():
            start = time.perf_counter()
            connection.execute(ddl)
            timings[name] = time.perf_counter() - start
        # Sets the visibility map too, as autovacuum would have on a table that grew slowly.
        connection.execute("VACUUM ANALYZE events")
        _checkpoint(connection)
    return timings


def _time_prune(url: str, older_than: timedelta, now: datetime) -> tuple[int, float, list[float]]:
    """``prune_events`` from a fresh ``Catalog``: (deleted, seconds, milliseconds per batch)."""
    from sqlalchemy import event

    with Catalog(url) as catalog:
        commits: list[float] = []
        event.listen(catalog._db.engine, "commit", lambda _c: commits.append(time.perf_counter()))
        start = time.perf_counter()
        deleted = catalog.prune_events(older_than=older_than, now=now)
        seconds = time.perf_counter() - start
    marks = [start, *commits]
    return deleted, seconds, [(b - a) * 1000 for a, b in zip(marks, marks[1:], strict=False)]


def section_events(args: argparse.Namespace, results: list[Row]) -> list[Row]:
    """``latest_committed`` with ``--events`` events beside the checkpoints, then pruning."""
    rows = []
    size = f"{args.runs * args.per_run:,} checkpoints + {args.events:,} events"
    for backend in args.backends:
        with BACKENDS[backend]() as url:
            names = populate(url, args.runs, args.per_run)
            expected = max(s for s in range(args.per_run) if _state(s, args.per_run) == "committed")
            # The same database just before the events arrive: the baseline of the ratio,
            # measured minutes rather than sections apart on a shared machine.
            before = time_latest(url, names, args.lookups, args.seed, expected)
            now = datetime.now(UTC)
            loader = _load_events_sqlite if backend == "sqlite" else _load_events_postgres
            print(f"  {backend}: loading {args.events:,} events ...", file=sys.stderr)
            load = loader(url, args.events, args.runs, now)
            samples = time_latest(url, names, args.lookups, args.seed + 1, expected)
            p50, p99 = percentile(samples, 0.50), percentile(samples, 0.99)
            b50, b99 = percentile(before, 0.50), percentile(before, 0.99)
            figures = {
                "without events p50/p99": f"{b50:.3f}/{b99:.3f} ms",
                "ratio p50": f"{p50 / b50:.2f}x",
                "mean": f"{statistics.fmean(samples):.3f} ms",
                "event insert": f"{load['insert']:.1f} s",
                "ix_events_at build": f"{load['ix_events_at']:.1f} s",
                "ix_events_run_name_at build": f"{load['ix_events_run_name_at']:.1f} s",
            }
            rows.append(Row("latest_committed with events", backend, size, p50, p99, figures))
            print(f"  {backend}: latest p50 {p50:.3f} ms, p99 {p99:.3f} ms", file=sys.stderr)

            # The older half of the log: everything before the middle of its time span.
            older_than = _event_span(now) / 2
            deleted, seconds, batches = _time_prune(url, older_than, now)
        rows.append(
            Row(
                "prune_events (older half)",
                backend,
                f"{args.events:,} events, {deleted:,} deleted",
                percentile(batches, 0.50),
                percentile(batches, 0.99),
                {
                    "total": f"{seconds:.1f} s",
                    "rate": f"{deleted / seconds:,.0f} events/s",
                    "batches": f"{len(batches):,} of up to {PRUNE_BATCH:,} events",
                    "longest batch": f"{max(batches):.1f} ms",
                },
            )
        )
        print(f"  {backend}: pruned {deleted:,} in {seconds:.1f} s", file=sys.stderr)
    return rows


SECTIONS: dict[str, Callable[[argparse.Namespace, list[Row]], list[Row]]] = {
    "latest": section_catalog_latest,
    "events": section_events,
    "scan": section_storage_scan,
    "gc": section_gc_requests,
}


# -- output ------------------------------------------------------------------------------------


def format_table(rows: list[Row]) -> str:
    header = ("section", "backend", "size", "p50", "p99", "details")
    lines = [
        (
            row.section,
            row.backend,
            row.size,
            "-" if row.p50_ms is None else f"{row.p50_ms:.3f} ms",
            "-" if row.p99_ms is None else f"{row.p99_ms:.3f} ms",
            ", ".join(f"{k} {v}" for k, v in row.figures.items()),
        )
        for row in rows
    ]
    widths = [max(len(str(c)) for c in column) for column in zip(header, *lines, strict=True)]
    render = [
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in (header, *lines)
    ]
    render.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(render)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--per-run", type=int, default=1000)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="100 runs x 100 checkpoints")
    parser.add_argument(
        "--backends",
        default="sqlite,postgresql",
        help="comma-separated subset of: " + ", ".join(BACKENDS),
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scan-steps",
        type=int,
        default=10_000,
        help="checkpoints of the S3 run the storage scan lists",
    )
    parser.add_argument("--gc-checkpoints", type=int, default=100)
    parser.add_argument("--gc-files", type=int, default=100)
    parser.add_argument(
        "--events", type=int, default=10_000_000, help="audit events of the events section"
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated subset of: " + ", ".join(SECTIONS),
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.per_run, args.lookups = 100, 100, 500
        args.scan_steps, args.gc_checkpoints, args.gc_files = 500, 10, 10
        args.events = 100_000
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown_sections = sorted(set(args.sections) - set(SECTIONS))
    if unknown_sections:
        parser.error(f"unknown section(s) {', '.join(unknown_sections)}")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    if args.per_run < 2 or args.runs < 1 or args.lookups < 1 or args.events < 2:
        parser.error("--runs and --lookups must be >= 1, --per-run and --events >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[Row] = []
    for name in args.sections:
        section = SECTIONS[name]
        print(f"running {section.__name__} ...", file=sys.stderr)
        results.extend(section(args, results))
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
