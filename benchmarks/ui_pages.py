"""Page loads of ``zephon ui`` over a large catalog, on SQLite and PostgreSQL.

    python benchmarks/ui_pages.py                     # 1,000 runs x 1,000 checkpoints
    python benchmarks/ui_pages.py --quick             # 50 x 50, a few seconds
    python benchmarks/ui_pages.py --backends sqlite --loads 200 --browser 30

For each backend: create a catalog (``Catalog(url)``), bulk-load ``runs x per_run``
checkpoint rows as a job with a local tier leaves them (timings by phase, three attempts,
an emergency save per attempt, most rows deleted by retention, one save_dir replica per
row and local ones for the newest), and the audit events of ``--event-runs`` runs (two per
save: ``begun`` and ``committed`` with its timings; a run's page reads only its own events,
through the ``(run_name, at)`` index, so the other runs' logs would change nothing it reads).
Then it starts ``zephon ui`` as a process of its own and times, over one kept-alive HTTP
connection, ``--loads`` GETs of each page kind after a warm-up: the runs page of a random
page of 50 runs, its JSON, the page of a random run (of those with events), and its JSON:
p50 and p95 in ms. Goal (issue 25): p95 <= 300 ms at 1,000 x 1,000. First views: over
``--starts`` fresh starts of the server each, every runs page (HTML, then JSON) viewed once
in a random order right after the start, while the server's background thread computes
every run's goodput, which a page viewed before it got there computes itself.

Baselines measured in the same run: the server's floor (a static file through the same
middleware), and ``Catalog.list_runs()`` in-process (what ``zephon runs`` reads: every
run's aggregates over the whole table), which an unpaged runs page would pay at least.
``--browser N`` also loads each HTML page N times in headless chromium (/usr/bin/chromium)
and reports the page load as the browser measures it (Navigation Timing: from navigation
start to the end of the load event; the charts are SVG inside the page, so they are drawn
by then), and the wall time the driver saw until every chart was laid out.

PostgreSQL: ``ZEPHON_TEST_POSTGRES_URL`` or postgresql+psycopg://postgres@127.0.0.1:5432/test;
the benchmark works in a throwaway database ``zephon_bench_<random>``, dropped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common

from _common import servers, table  # noqa: E402
from sqlalchemy import create_engine, insert, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from tests.zephon.ui.conftest import start, stop  # noqa: E402
from zephon.catalog import Catalog  # noqa: E402
from zephon.catalog.models import Run  # noqa: E402

GOAL_P95_MS = 300.0
ATTEMPTS = 3
BASE = datetime(2026, 1, 1, tzinfo=UTC)


# -- databases ---------------------------------------------------------------------------------


@contextlib.contextmanager
def sqlite_database() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as directory:
        yield f"sqlite:///{directory}/catalog.db"


def postgres_database() -> contextlib.AbstractContextManager[str]:
    return servers.postgres_database(servers.postgres_url(), prefix="zephon_bench")


BACKENDS = {"sqlite": sqlite_database, "postgresql": postgres_database}


# -- rows --------------------------------------------------------------------------------------


def _timings(step: int) -> dict[str, float]:
    write = 0.5 + (step % 7) / 10
    return {
        "stall_s": round(write / 4, 3),
        "write_s": round(write, 3),
        "commit_s": 0.05,
        "local_s": round(write / 2, 3),
        "upload_s": round(2 * write, 3),
        "total_s": round(3.05 * write, 3),
    }


def _epoch_of(step: int, per_run: int) -> int:
    return 1 + step * ATTEMPTS // per_run


def _checkpoints(run_ids: list[int], per_run: int) -> Iterator[tuple]:
    for run_id in run_ids:
        for step in range(per_run):
            at = BASE + timedelta(seconds=60 * step)
            state = "committed" if step >= per_run - 3 or step % 100 == 0 else "deleted"
            if step == per_run - 1:
                state = "pending"
            epoch = _epoch_of(step, per_run)
            last_of_epoch = _epoch_of(step + 1, per_run) != epoch
            meta = json.dumps({"trigger": "emergency"}) if last_of_epoch else None
            committed = None if state == "pending" else at + timedelta(seconds=2)
            timings = None if state == "pending" else _timings(step)
            yield (
                run_id,
                step,
                state,
                f"s3://bench/r{run_id}/save-{step}",
                f"s{step}",
                epoch,
                1 << 30,
                step % 100 == 0,
                meta,
                json.dumps(timings) if timings else None,
                timings["stall_s"] if timings else None,  # as the catalog writes it
                at,
                committed,
                committed or at,
            )


CHECKPOINT_COLUMNS = (
    "run_id",
    "step",
    "state",
    "path",
    "save_id",
    "epoch",
    "bytes",
    "pinned",
    "metadata",
    "timings",
    "stall_s",
    "created_at",
    "committed_at",
    "updated_at",
)


def _replicas(run_ids: list[int], per_run: int) -> Iterator[tuple]:
    for run_id in run_ids:
        for step in range(per_run):
            at = BASE + timedelta(seconds=60 * step)
            live = step >= per_run - 3
            state = "committed" if live else "deleted"
            for tier, host, done in (("local", "n1", 1), ("save_dir", "", 4)):
                if tier == "local" and not live:
                    continue
                yield (
                    run_id,
                    step,
                    tier,
                    host,
                    f"/bench/r{run_id}/save-{step}",
                    f"s{step}",
                    state,
                    1 << 30,
                    at,
                    at + timedelta(seconds=done),
                    at + timedelta(seconds=done),
                )


REPLICA_COLUMNS = (
    "run_id",
    "step",
    "tier",
    "host",
    "location",
    "save_id",
    "state",
    "bytes",
    "created_at",
    "committed_at",
    "updated_at",
)


def _attempts(run_ids: list[int], per_run: int) -> Iterator[tuple]:
    for run_id in run_ids:
        for epoch in range(1, ATTEMPTS + 1):
            first = min(s for s in range(per_run) if _epoch_of(s, per_run) == epoch)
            at = BASE + timedelta(seconds=60 * first - 30)
            resumed = None if epoch == 1 else first - 1
            yield (run_id, epoch, f"a{epoch}", "n1", 100 + epoch, at, resumed, at, at)


ATTEMPT_COLUMNS = (
    "run_id",
    "epoch",
    "attempt_id",
    "host",
    "pid",
    "started_at",
    "resumed_from",
    "registered_at",
    "decided_at",
)


def _events(names: list[str], per_run: int) -> Iterator[tuple]:
    for name in names:
        for step in range(per_run):
            at = BASE + timedelta(seconds=60 * step)
            epoch = _epoch_of(step, per_run)
            begun = json.dumps({"save_id": f"s{step}", "epoch": epoch})
            done = json.dumps({"save_id": f"s{step}", "epoch": epoch, "timings": {"stall_s": 0.2}})
            yield (at, "bench", "begun", name, step, begun)
            yield (at + timedelta(seconds=2), "bench", "committed", name, step, done)


EVENT_COLUMNS = ("at", "actor", "action", "run_name", "step", "detail")


def _stamp(value):
    # the text form UtcDateTime stores on SQLite: naive UTC with microseconds
    if isinstance(value, datetime):
        return value.replace(tzinfo=None).isoformat(" ", "microseconds")
    return value


def _load_sqlite(url: str, tables: dict) -> None:
    import sqlite3

    connection = sqlite3.connect(make_url(url).database, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        for name, (columns, rows) in tables.items():
            marks = ", ".join("?" * len(columns))
            connection.executemany(
                f"INSERT INTO {name} ({', '.join(columns)}) VALUES ({marks})",
                (tuple(_stamp(v) for v in row) for row in rows),
            )
        connection.execute("COMMIT")
        connection.execute("ANALYZE")
    finally:
        connection.close()


def _load_postgres(url: str, tables: dict) -> None:
    import psycopg

    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn) as connection:
        with connection.cursor() as cursor:
            for name, (columns, rows) in tables.items():
                with cursor.copy(f"COPY {name} ({', '.join(columns)}) FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
        connection.commit()
        connection.autocommit = True
        # what autovacuum does to a catalog that grew over months: statistics, and the
        # visibility map that lets the goodput reads stay index-only
        connection.execute("VACUUM (ANALYZE)")
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            connection.execute("CHECKPOINT")


def populate(url: str, runs: int, per_run: int, event_runs: int) -> list[str]:
    """Create the schema through ``Catalog``, bulk-load the rows; the run names."""
    Catalog(url).close()
    names = [f"run-{i:05d}" for i in range(runs)]
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
                        num_to_keep=3,
                        epoch=ATTEMPTS,
                        total_steps=per_run * 2,
                        created_at=BASE,
                        updated_at=BASE,
                    )
                    for n in names
                ],
            )
            run_ids = list(connection.execute(text("SELECT id FROM runs ORDER BY id")).scalars())
    finally:
        engine.dispose()
    tables = {
        "checkpoints": (CHECKPOINT_COLUMNS, _checkpoints(run_ids, per_run)),
        "checkpoint_replicas": (REPLICA_COLUMNS, _replicas(run_ids, per_run)),
        "attempts": (ATTEMPT_COLUMNS, _attempts(run_ids, per_run)),
        "events": (EVENT_COLUMNS, _events(names[:event_runs], per_run)),
    }
    (_load_sqlite if url.startswith("sqlite") else _load_postgres)(url, tables)
    return names


# -- timing ------------------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_gets(base: str, paths: list[str], warmup: int = 5) -> list[float]:
    """Milliseconds per GET of each of ``paths`` (status 200 checked), over one connection."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    samples = []
    try:
        for index, path in enumerate(paths[:warmup] + paths):
            start = time.perf_counter()
            connection.request("GET", path)
            response = connection.getresponse()
            body = response.read()
            elapsed = (time.perf_counter() - start) * 1000
            assert response.status == 200, (path, response.status, body[:200])
            if index >= warmup:
                samples.append(elapsed)
    finally:
        connection.close()
    return samples


def time_browser(base: str, paths: list[str]) -> tuple[list[float], list[float]]:
    """Page loads of ``paths`` in headless chromium, after one warm-up load: the browser's own
    measure (Navigation Timing's ``loadEventEnd``: from navigation start until the page,
    its charts included, is loaded), and the wall time the driver saw from ``goto`` until
    every chart is laid out (which adds playwright's round trips to the browser)."""
    from playwright.sync_api import sync_playwright

    from tests.zephon.ui.conftest import CHROMIUM_FLAGS
    from tests.zephon.ui.screenshots import charts_drawn

    loads, walls = [], []
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_FLAGS
        )
        try:
            page = context.new_page()
            for index, path in enumerate(paths[:1] + paths):
                start = time.perf_counter()
                page.goto(base + path, wait_until="load")
                if page.locator("[data-chart]").count():
                    charts_drawn(page)
                wall = (time.perf_counter() - start) * 1000
                load = page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd")
                if index:
                    loads.append(load)
                    walls.append(wall)
        finally:
            context.close()
    return loads, walls


def measure(url: str, names: list[str], args: argparse.Namespace) -> list[tuple]:
    chooser = random.Random(args.seed)
    pages = max(1, -(-len(names) // 50))
    with_events = names[: args.event_runs]
    kinds = {
        "static file (server floor)": ["/static/ui.css"] * args.loads,
        "runs page (HTML, 50 runs)": [
            f"/runs?page={chooser.randint(1, pages)}&refresh=0" for _ in range(args.loads)
        ],
        "runs page JSON": [
            f"/api/runs?page={chooser.randint(1, pages)}" for _ in range(args.loads)
        ],
        "run page (HTML)": [
            f"/runs/{chooser.choice(with_events)}?refresh=0" for _ in range(args.loads)
        ],
        "run page JSON": [f"/api/runs/{chooser.choice(with_events)}" for _ in range(args.loads)],
    }
    rows = []
    with Catalog(url, read_only=True) as catalog:
        listed = []
        for _ in range(3):
            start = time.perf_counter()
            catalog.list_runs()
            listed.append((time.perf_counter() - start) * 1000)
    cold = {
        "runs page (HTML), first views after start": "/runs?page={}&refresh=0",
        "runs page JSON, first views after start": "/api/runs?page={}",
    }
    for kind, path in cold.items():
        samples = first_views(url, [path.format(p) for p in range(1, pages + 1)], args, chooser)
        rows.append(
            (kind, "http", len(samples), percentile(samples, 0.5), percentile(samples, 0.95))
        )
    process, base = start_server(url)
    try:
        # warm: every page's goodput computed (by the background thread, or by this view)
        time_gets(base, [f"/api/runs?page={p}" for p in range(1, pages + 1)], warmup=0)
        for kind, paths in kinds.items():
            samples = time_gets(base, paths)
            rows.append(
                (kind, "http", len(samples), percentile(samples, 0.5), percentile(samples, 0.95))
            )
        if args.browser:
            for kind, path in (("runs page", "/runs?page=2&refresh=0"), ("run page", None)):
                paths = [
                    path or f"/runs/{chooser.choice(with_events)}?refresh=0"
                    for _ in range(args.browser)
                ]
                loads, walls = time_browser(base, paths)
                for how, samples in (("load event", loads), ("driver's wall time", walls)):
                    rows.append(
                        (
                            f"{kind} in chromium, {how}",
                            "browser",
                            len(samples),
                            percentile(samples, 0.5),
                            percentile(samples, 0.95),
                        )
                    )
    finally:
        stop(process)
    rows.append(
        (
            "baseline: Catalog.list_runs() (unpaged)",
            "in-process",
            len(listed),
            percentile(listed, 0.5),
            max(listed),
        )
    )
    return rows


def start_server(url: str):
    return start(["--catalog", url, "--port", "0", "--refresh", "0"])


def first_views(
    url: str, paths: list[str], args: argparse.Namespace, chooser: random.Random
) -> list[float]:
    """Milliseconds of each of ``paths`` viewed once, in a random order, right after a start
    of the server (nothing discarded as warm-up), over ``--starts`` starts: the views that
    come before the server's background thread has computed every run's goodput."""
    samples = []
    for _ in range(args.starts):
        process, base = start_server(url)
        try:
            samples += time_gets(base, chooser.sample(paths, len(paths)), warmup=0)
        finally:
            stop(process)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--per-run", type=int, default=1000)
    parser.add_argument("--event-runs", type=int, default=20)
    parser.add_argument("--loads", type=int, default=100)
    parser.add_argument(
        "--starts",
        type=int,
        default=3,
        help="server starts after which every runs page is viewed once (HTML, then JSON)",
    )
    parser.add_argument("--browser", type=int, default=0, metavar="N")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="50 runs x 50, 20 loads")
    parser.add_argument(
        "--catalog",
        metavar="URL",
        help="measure this catalog, filled by an earlier run of this script, instead of "
        "building one (its runs, --event-runs and sizes must match)",
    )
    args = parser.parse_args()
    if args.quick:
        args.runs, args.per_run, args.loads, args.event_runs = 50, 50, 20, 5
    args.event_runs = min(args.event_runs, args.runs)
    print(
        f"zephon ui page loads: {args.runs:,} runs x {args.per_run:,} checkpoints "
        f"({args.runs * args.per_run:,} rows), {args.loads} loads per page kind"
    )
    for backend in args.backends.split(",") if not args.catalog else ["given"]:
        with contextlib.nullcontext(args.catalog) if args.catalog else BACKENDS[backend]() as url:
            start_s = time.perf_counter()
            if args.catalog:
                names = [f"run-{i:05d}" for i in range(args.runs)]
            else:
                names = populate(url, args.runs, args.per_run, args.event_runs)
            built = time.perf_counter() - start_s
            rows = measure(url, names, args)
        floor = next(r[3] for r in rows if r[0].startswith("static file"))
        listed = rows[-1][3]
        print(f"\n{backend}: catalog built in {built:.1f} s; load average {os.getloadavg()}")
        print(
            table(
                [
                    (
                        kind,
                        how,
                        n,
                        f"{p50:.1f}",
                        f"{p95:.1f}",
                        f"{p50 / floor:.1f}x" if how == "http" else "-",
                        "yes" if p95 <= GOAL_P95_MS else "NO",
                    )
                    for kind, how, n, p50, p95 in rows
                ],
                ("page", "via", "loads", "p50 ms", "p95 ms", "p50 / floor", "p95 <= 300"),
            )
        )
        paged = next(r[3] for r in rows if r[0] == "runs page JSON")
        print(f"unpaged list_runs / paged runs JSON (p50): {listed / paged:.1f}x")


if __name__ == "__main__":
    main()
