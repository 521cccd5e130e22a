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
- a fresh ``python -c "import s3fs; ...ls(run)"`` of the S3 run: the cheapest way to ask S3
  anything from a new process, which ``zephon latest`` must beat (issue 22: at most 0.25 s and
  less than this).

Then, once per case, the heavy modules the process loaded (``sys.modules`` at exit).
"""

from __future__ import annotations

import argparse
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


def _populate(catalog_url: str, s3_url: str, s3_options: dict, local_url: str) -> None:
    """A catalog with two runs of three checkpoints each: one on local disk, one on S3."""
    from tests.zephon.saves import save_step, start
    from zephon.catalog import Catalog
    from zephon.locations import run_location
    from zephon.storage import CheckpointStore

    with Catalog(catalog_url) as catalog:
        for name, url, options in (("local-run", local_url, {}), ("s3-run", s3_url, s3_options)):
            store = CheckpointStore(url, options)
            record = catalog.ensure_run(name, store.location.canonical_url)
            location = run_location(record, options)
            attempt = start(location, catalog)
            for step in (10, 20, 30):
                save_step(attempt, step, catalog)


def _cases(zephon: str, s3_options: dict) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, the same as Python code run through the probe for its modules)."""
    python = sys.executable
    ls = f"import s3fs; s3fs.S3FileSystem(**{s3_options!r}).ls({BUCKET + '/ckpt/s3-run'!r})"
    main = "from zephon.cli import main; sys.exit(main({}))"
    return {
        "python -c pass": ([python, "-c", "pass"], "pass"),
        "import zephon": ([python, "-c", "import zephon"], "import zephon"),
        "zephon --help": ([zephon, "--help"], main.format(["--help"])),
        "zephon latest (local run)": (
            [zephon, "latest", "local-run"],
            main.format(["latest", "local-run"]),
        ),
        "zephon latest (S3 run)": ([zephon, "latest", "s3-run"], main.format(["latest", "s3-run"])),
        "s3fs ls of the S3 run": ([python, "-c", ls], ls),
    }


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
    args = parser.parse_args()
    zephon = os.path.join(os.path.dirname(sys.executable), "zephon")
    with servers.s3_server() as s3, tempfile.TemporaryDirectory(prefix="zephon-cli-") as tmp:
        s3.create_bucket(BUCKET)
        options = s3.storage_options()
        catalog_url = f"sqlite:///{tmp}/catalog.db"
        _populate(catalog_url, f"s3://{BUCKET}/ckpt", options, os.path.join(tmp, "ckpt"))
        env = {
            **os.environ,
            "ZEPHON_CATALOG_URL": catalog_url,
            "ZEPHON_STORAGE_OPTIONS": json.dumps(options),
        }
        cases = _cases(zephon, options)
        for argv, _ in cases.values():  # warm the page cache and the bytecode caches
            _run(argv, env)
        walls: dict[str, list[float]] = {name: [] for name in cases}
        cpus: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            order = list(cases)
            random.shuffle(order)
            for name in order:
                wall, cpu = _run(cases[name][0], env)
                walls[name].append(wall)
                cpus[name].append(cpu)
        floor = statistics.median(walls["python -c pass"])
        ls_wall = statistics.median(walls["s3fs ls of the S3 run"])
        rows = []
        for name, (_, code) in cases.items():
            wall = statistics.median(walls[name])
            rows.append(
                (
                    name,
                    f"{wall:.3f}",
                    f"{statistics.median(cpus[name]):.3f}",
                    f"{wall - floor:+.3f}",
                    f"{wall / ls_wall:.2f}",
                    _modules(code, env),
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
