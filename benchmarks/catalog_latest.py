"""Latest-checkpoint lookup through the catalog, at scale, on SQLite and PostgreSQL.

    python benchmarks/catalog_latest.py                 # 1,000 runs x 1,000 checkpoints
    python benchmarks/catalog_latest.py --quick         # 100 x 100, a few seconds
    python benchmarks/catalog_latest.py --runs 200 --per-run 5000 --lookups 5000

For each backend: create a catalog (Alembic, as ``Catalog(url)`` does), bulk-load
``runs x per_run`` checkpoint rows (executemany on SQLite, COPY on PostgreSQL), ANALYZE, then time
``Catalog.latest_committed(run)`` for random runs: p50/p99 over ``--lookups`` calls, after a
warm-up. Goal (issue 3): p50 <= 5 ms with 1M rows.

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

from catalog import Catalog
from catalog.models import Run

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


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A throwaway database on the benchmark server; dropped however the benchmark ends."""
    import psycopg

    server = make_url(os.environ.get("ZEPHON_TEST_POSTGRES_URL", POSTGRES_DEFAULT))
    admin_dsn = server.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"zephon_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
            yield (run_id, step, state, f"s3://bench/r{run_id}/save-{step}", "bench",
                   state != "pending" and step * 1000 or None, False, at, committed, at)


_COLUMNS = ("run_id", "step", "state", "path", "attempt_id", "bytes", "pinned", "created_at",
            "committed_at", "updated_at")


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
            ((*row[:7], stamp(row[7]), stamp(row[8]), stamp(row[9]))
             for row in _checkpoint_rows(run_ids, per_run)),
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
                [dict(name=n, storage_url=f"s3://bench/{n}", kind="train", status="active",
                      num_to_keep=2, created_at=now, updated_at=now) for n in names],
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


SECTIONS: list[Callable[[argparse.Namespace, list[Row]], list[Row]]] = [
    section_catalog_latest,
]


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
    render = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
              for line in (header, *lines)]
    render.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(render)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--per-run", type=int, default=1000)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="100 runs x 100 checkpoints")
    parser.add_argument("--backends", default="sqlite,postgresql",
                        help="comma-separated subset of: " + ", ".join(BACKENDS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.per_run, args.lookups = 100, 100, 500
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    if args.per_run < 2 or args.runs < 1 or args.lookups < 1:
        parser.error("--runs and --lookups must be >= 1, --per-run >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[Row] = []
    for section in SECTIONS:
        print(f"running {section.__name__} ...", file=sys.stderr)
        results.extend(section(args, results))
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
