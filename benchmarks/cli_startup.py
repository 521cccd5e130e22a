"""How fast the ``zephon`` command answers: each case a fresh process, as a user or a script
runs it.

    python benchmarks/cli_startup.py              # 15 interleaved repeats
    python benchmarks/cli_startup.py --repeats 40

Cases, each timed as a whole process (``subprocess.run``): wall time (median over the repeats)
and CPU-seconds (user + system of the child, ``getrusage``; noise on a shared machine moves it
less than wall time). Every repeat runs every case once, in a new random order, so a load change
hits them alike:

- ``python -c pass``: the interpreter alone, the floor;
- ``python -c "import zephon"``;
- ``zephon --help``: the parser of every subcommand;
- ``zephon latest RUN`` with a SQLite catalog, for a run on local disk and a run on S3 (moto);
- the same command's full lookup (``Catalog``: the ORM and the models), the one it took before
  ``catalog.latest_alone`` and still takes when the catalog cannot answer alone: the in-run
  baseline of what the lookup without the ORM saves (forced in the child by replacing
  ``latest_alone`` with a function that declines);
- with ``--postgres`` (or when PostgreSQL answers at ``ZEPHON_TEST_POSTGRES_URL`` /
  127.0.0.1:5432), ``zephon latest`` and its full lookup on a PostgreSQL catalog holding the
  local run, in a database of its own;
- a fresh ``python -c "import s3fs; ...ls(run)"`` of the S3 run: the cheapest way to ask S3
  anything from a new process, which ``zephon latest`` must beat (issue 22: at most 0.25 s and
  less than this).

Then, once per case, the heavy modules the process loaded (``sys.modules`` at exit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common

from _common import servers, table  # noqa: E402

#: modules a quick command should not need; each is reported when a case loads it
HEAVY = (
    "sqlalchemy",
    "alembic",
    "torch",
    "numpy",
    "fsspec",
    "s3fs",
    "gcsfs",
    "adlfs",
    "aiohttp",
    "botocore",
    "rich",
    "yaml",
)
GOAL_S = 0.25
BUCKET = "zephon-cli-bench"

# Run the case's code, then print its heavy modules to stderr's last line; for the module list.
_PROBE = (
    "import atexit, sys\n"
    "def _report():\n"
    "    heavy = {m.split('.')[0] for m in sys.modules} & set(HEAVY)\n"
    "    sys.stderr.write('\\nMODULES ' + ' '.join(sorted(heavy)) + '\\n')\n"
    "atexit.register(_report)\n"
)


def _populate(catalog_url: str, s3_url: str | None, s3_options: dict, local_url: str) -> None:
    """A catalog with two runs of three checkpoints each: one on local disk, one on S3 (none
    without ``s3_url``)."""
    from tests.zephon.saves import save_step, start
    from zephon.catalog import Catalog
    from zephon.locations import run_location
    from zephon.storage import CheckpointStore

    with Catalog(catalog_url) as catalog:
        runs = [("local-run", local_url, {}), ("s3-run", s3_url, s3_options)]
        for name, url, options in runs[: 2 if s3_url else 1]:
            store = CheckpointStore(url, options)
            record = catalog.ensure_run(name, store.location.canonical_url)
            location = run_location(record, options)
            attempt = start(location, catalog)
            for step in (10, 20, 30):
                save_step(attempt, step, catalog)


#: the child's code for ``zephon latest``'s full lookup: the lookup without the ORM declines
_FULL = (
    "import sys, zephon.cli.latest as quick\n"
    "quick.latest_alone = lambda url, run: None\n"
    "from zephon.cli import main; sys.exit(main({}))"
)


def _cases(
    zephon: str, s3_options: dict, postgres_url: str | None
) -> dict[str, tuple[list[str], str, dict]]:
    """name -> (argv, the same as Python code run through the probe for its modules, extra
    environment)."""
    python = sys.executable
    ls = f"import s3fs; s3fs.S3FileSystem(**{s3_options!r}).ls({BUCKET + '/ckpt/s3-run'!r})"
    main = "from zephon.cli import main; sys.exit(main({}))"
    full = _FULL.format(["latest", "local-run"])
    cases = {
        "python -c pass": ([python, "-c", "pass"], "pass"),
        "import zephon": ([python, "-c", "import zephon"], "import zephon"),
        "zephon --help": ([zephon, "--help"], main.format(["--help"])),
        "zephon latest (local run)": (
            [zephon, "latest", "local-run"],
            main.format(["latest", "local-run"]),
        ),
        "zephon latest (S3 run)": ([zephon, "latest", "s3-run"], main.format(["latest", "s3-run"])),
        "full lookup (local run)": ([python, "-c", full], full),
        "s3fs ls of the S3 run": ([python, "-c", ls], ls),
    }
    cases = {name: (argv, code, {}) for name, (argv, code) in cases.items()}
    if postgres_url is not None:
        pg = {"ZEPHON_CATALOG_URL": postgres_url}
        latest = main.format(["latest", "local-run"])
        cases["zephon latest (PostgreSQL)"] = ([zephon, "latest", "local-run"], latest, pg)
        cases["full lookup (PostgreSQL)"] = ([python, "-c", full], full, pg)
    return cases


def _postgres(wanted: bool | None) -> contextlib.AbstractContextManager[str | None]:
    """A database of its own on the PostgreSQL server, or None (``--no-postgres``, or no server
    answers and ``--postgres`` was not asked for)."""
    url = servers.postgres_url()
    reason = servers.postgres_reachable(url) if wanted is not False else "not asked for"
    if reason is not None:
        if wanted:
            raise SystemExit(f"--postgres: {reason}")
        return contextlib.nullcontext(None)
    return servers.postgres_database(url, prefix="zephon_bench")


def _run(argv: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds and CPU-seconds (user + system) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _modules(code: str, env: dict) -> str:
    probe = _PROBE.replace("set(HEAVY)", repr(set(HEAVY))) + code
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    line = [x for x in done.stderr.splitlines() if x.startswith("MODULES")]
    return line[-1][len("MODULES ") :] or "-" if line else f"(failed: {done.stderr.strip()})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--postgres",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time a PostgreSQL catalog (default: when the server answers)",
    )
    args = parser.parse_args()
    zephon = os.path.join(os.path.dirname(sys.executable), "zephon")
    with (
        servers.s3_server() as s3,
        tempfile.TemporaryDirectory(prefix="zephon-cli-") as tmp,
        _postgres(args.postgres) as postgres_url,
    ):
        s3.create_bucket(BUCKET)
        options = s3.storage_options()
        catalog_url = f"sqlite:///{tmp}/catalog.db"
        local = os.path.join(tmp, "ckpt")
        _populate(catalog_url, f"s3://{BUCKET}/ckpt", options, local)
        if postgres_url is not None:
            _populate(postgres_url, None, options, local + "-pg")
        base_env = {
            **os.environ,
            "ZEPHON_CATALOG_URL": catalog_url,
            "ZEPHON_STORAGE_OPTIONS": json.dumps(options),
        }
        cases = _cases(zephon, options, postgres_url)
        envs = {name: {**base_env, **extra} for name, (_, _, extra) in cases.items()}
        for name, (argv, _, _) in cases.items():  # warm the page cache and the bytecode caches
            _run(argv, envs[name])
        walls: dict[str, list[float]] = {name: [] for name in cases}
        cpus: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            order = list(cases)
            random.shuffle(order)
            for name in order:
                wall, cpu = _run(cases[name][0], envs[name])
                walls[name].append(wall)
                cpus[name].append(cpu)
        floor = statistics.median(walls["python -c pass"])
        ls_wall = statistics.median(walls["s3fs ls of the S3 run"])
        rows = []
        for name, (_, code, _) in cases.items():
            wall = statistics.median(walls[name])
            rows.append(
                (
                    name,
                    f"{wall:.3f}",
                    f"{statistics.median(cpus[name]):.3f}",
                    f"{wall - floor:+.3f}",
                    f"{wall / ls_wall:.2f}",
                    _modules(code, envs[name]),
                )
            )
    print(
        f"{args.repeats} interleaved repeats; wall and CPU-seconds are medians; "
        f"goal for zephon latest: <= {GOAL_S} s wall and less than the s3fs ls process\n"
    )
    headers = ("case", "wall s", "CPU s", "over python", "/ s3fs ls", "heavy modules loaded")
    print(table(rows, headers))


if __name__ == "__main__":
    main()
