"""The catalog, gc, verify and sync subcommands of ``zephon``: each takes the parsed arguments
and returns the process exit code. None of them imports torch."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import catalog as catalog_pkg
from catalog import Catalog
from storage import CheckpointStore
from zephon.cli.render import console, human_bytes, print_json, print_table
from zephon.errors import ConfigError
from zephon.gc import GcPolicy, collect_garbage
from zephon.latest import find_latest
from zephon.locations import (
    RunLocation,
    resolve_catalog_url,
    run_location,
    storage_options_from_env,
)
from zephon.sync import sync_storage

T = TypeVar("T")

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_PROBLEMS = 3

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> dt.timedelta:
    """``90``, ``90s``, ``30m``, ``24h``, ``7d`` or ``2w``."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number with an optional unit s, m, h, d or w, "
            "e.g. 24h or 30m"
        )
    return dt.timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


def open_catalog(args: argparse.Namespace, *, check_schema: bool = True) -> Catalog:
    return Catalog(resolve_catalog_url(args.catalog), check_schema=check_schema)


def _progress() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def cmd_runs(args: argparse.Namespace) -> int:
    with open_catalog(args) as cat:
        summaries = cat.list_runs()
    if args.json:
        print_json([s.to_dict() for s in summaries])
        return EXIT_OK
    print_table(
        f"{len(summaries)} run(s) in {cat.url}",
        [
            "run",
            "kind",
            "status",
            "checkpoints",
            "size",
            "latest step",
            "pending",
            "keep",
            "storage",
        ],
        [
            (
                s.run.name,
                s.run.kind,
                s.run.status,
                s.committed_count,
                human_bytes(s.committed_bytes),
                s.latest_step,
                s.pending_count,
                "all" if s.run.num_to_keep is None else s.run.num_to_keep,
                s.run.storage_url,
            )
            for s in summaries
        ],
    )
    return EXIT_OK


def cmd_checkpoints(args: argparse.Namespace) -> int:
    with open_catalog(args) as cat:
        rows = cat.list_checkpoints(args.run, states=args.state or None)
    if args.json:
        print_json([r.to_dict() for r in rows])
        return EXIT_OK
    print_table(
        f"checkpoints of run {args.run}",
        ["step", "state", "epoch", "size", "files", "pinned", "committed at", "path"],
        [
            (
                r.step,
                r.state,
                r.epoch,
                human_bytes(r.bytes),
                r.file_count,
                "yes" if r.pinned else "",
                r.committed_at.isoformat(timespec="seconds") if r.committed_at else None,
                r.path,
            )
            for r in rows
        ],
    )
    return EXIT_OK


@contextlib.contextmanager
def located(args: argparse.Namespace) -> Iterator[tuple[RunLocation, Any]]:
    """``(location, catalog or None)`` of ``args.run``, found through the catalog, or by
    scanning ``--save-dir`` without one; the catalog is closed after."""
    options = storage_options_from_env(args.storage_options)
    if args.save_dir:
        store = CheckpointStore(args.save_dir, options)
        yield RunLocation(args.run or "inference", store, args.run), None
        return
    if not args.run:
        raise ConfigError("name a RUN (from `zephon runs`), or give --save-dir to scan storage")
    with open_catalog(args) as cat:
        yield run_location(cat.get_run(args.run), options), cat


def choose_checkpoint(
    args: argparse.Namespace, action: str
) -> tuple[CheckpointStore, str | None, int] | None:
    """The checkpoint ``args`` name: ``--step``, else the run's latest complete one (None, with
    a message, when it has none)."""
    with located(args) as (location, cat):
        if args.step is not None:
            return location.store, location.storage_run, args.step
        latest = find_latest(location, catalog=cat)
    if latest is None:
        console.print(f"no complete checkpoint to {action} for run {args.run or '(inference)'}")
        return None
    return location.store, location.storage_run, latest.step


def with_progress(label: str, work: Callable[[Callable[[str], None]], T]) -> T:
    """Run ``work(report)`` under a spinner; ``report(name)`` shows the run being processed."""
    with _progress() as progress:
        task = progress.add_task(label)
        return work(lambda name: progress.update(task, description=f"{label} run {name}"))


def cmd_latest(args: argparse.Namespace) -> int:
    with located(args) as (location, cat):
        latest = find_latest(location, catalog=cat)
    if latest is None:
        if args.json:
            print_json(None)
        else:
            console.print(f"no complete checkpoint for run {args.run or '(inference)'}")
        return EXIT_NOT_FOUND
    if args.json:
        print_json(
            {
                "run": args.run,
                "step": latest.step,
                "url": latest.url,
                "source": latest.source,
                "bytes": latest.manifest.total_bytes,
                "promoted": list(latest.promoted),
                "missing": list(latest.missing),
            }
        )
    else:
        console.print(latest.url, soft_wrap=True)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    chosen = choose_checkpoint(args, "verify")
    if chosen is None:
        return EXIT_NOT_FOUND
    store, storage_run, step = chosen
    report = store.verify(storage_run, step, deep=args.deep)
    if args.json:
        print_json(
            {
                "url": report.url,
                "step": step,
                "deep": report.deep,
                "ok": report.ok,
                "files_checked": report.files_checked,
                "bytes_checked": report.bytes_checked,
                "problems": [
                    {"file": p.name, "kind": p.kind, "detail": p.detail} for p in report.problems
                ],
            }
        )
    elif report.ok:
        console.print(
            f"ok: {report.url}: {report.files_checked} files, "
            f"{human_bytes(report.bytes_checked)} "
            f"{'checksummed' if report.deep else 'present with the right sizes'}"
        )
    else:
        print_table(
            f"{report.url} failed verification",
            ["file", "problem"],
            [(p.name, p.detail) for p in report.problems],
        )
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_gc(args: argparse.Namespace) -> int:
    options = storage_options_from_env(args.storage_options)
    with open_catalog(args) as cat:
        report = with_progress(
            "gc",
            lambda report_run: collect_garbage(
                cat,
                runs=args.run or None,
                policy=GcPolicy(
                    grace=args.grace,
                    pending_grace=args.pending_grace,
                    lease=args.lease,
                    corrupt=args.corrupt,
                ),
                dry_run=args.dry_run,
                storage_options=options,
                progress=report_run,
            ),
        )
    if args.json:
        print_json(report.to_dict())
    else:
        verb = "would delete" if args.dry_run else "deleted"
        for item in report.deleted:
            console.print(f"{verb} {item['run']} step {item['step']}")
        for item in report.settled:
            console.print(
                f"settled unfinished save {item['run']} step {item['step']} -> {item['to']}"
            )
        for item in report.orphans:
            console.print(f"{'would remove' if args.dry_run else 'removed'} orphan {item['url']}")
        for problem in report.problems:
            console.print(f"problem: {problem}")
        console.print(
            f"gc{' (dry run)' if args.dry_run else ''}: {len(report.deleted)} checkpoint(s), "
            f"{len(report.orphans)} orphan(s), {len(report.settled)} unfinished save(s) settled, "
            f"{len(report.problems)} problem(s)"
        )
    return EXIT_PROBLEMS if report.problems else EXIT_OK


def cmd_sync(args: argparse.Namespace) -> int:
    options = storage_options_from_env(args.storage_options)
    with open_catalog(args) as cat:
        report = with_progress(
            "sync",
            lambda report_run: sync_storage(
                cat,
                args.url,
                options,
                inference_name=args.inference_name,
                progress=report_run,
            ),
        )
    if args.json:
        print_json(report.to_dict())
    else:
        counts = ", ".join(f"{v} {k}" for k, v in sorted(report.outcomes.items())) or "nothing"
        console.print(
            f"synced {len(report.runs)} run(s) from {report.url}: {counts}; "
            f"{len(report.marked_missing)} marked missing"
        )
        for problem in report.problems:
            console.print(f"problem: {problem}")
    return EXIT_PROBLEMS if report.problems else EXIT_OK


def cmd_pin(args: argparse.Namespace) -> int:
    with open_catalog(args) as cat:
        row = cat.pin(args.run, args.step) if args.pin else cat.unpin(args.run, args.step)
    if args.json:
        print_json(row.to_dict())
    else:
        console.print(f"{'pinned' if row.pinned else 'unpinned'} {row.run} step {row.step}")
    return EXIT_OK


def cmd_db(args: argparse.Namespace) -> int:
    url = resolve_catalog_url(args.catalog)
    if args.db_command == "upgrade":
        before, after = catalog_pkg.upgrade(url)
        result = {"catalog": catalog_pkg.mask_url(url), "before": before, "after": after}
        message = (
            f"catalog {result['catalog']} is at {after}"
            if before == after
            else f"upgraded {result['catalog']} from {before or 'empty'} to {after}"
        )
    else:
        current = catalog_pkg.current_revision(url)
        head = catalog_pkg.head_revision()
        result = {
            "catalog": catalog_pkg.mask_url(url),
            "current": current,
            "head": head,
            "up_to_date": current == head,
        }
        message = (
            f"{result['catalog']}: schema {current or 'none'} "
            f"({'up to date' if current == head else f'head is {head}: run zephon db upgrade'})"
        )
    if args.json:
        print_json(result)
    else:
        console.print(message)
    return EXIT_OK
