"""The catalog, gc, verify and sync subcommands of ``zephon``: each takes the parsed arguments
and returns the process exit code. None of them imports torch. Every subcommand runs inside
``zephon.cli.boundary.at_boundary``.

What only some commands need is imported inside them (gc and sync, the storage backends, rich's
progress display), so that a command the catalog answers loads the catalog and nothing else
(``zephon latest`` starts in ``zephon.cli.latest``, which answers without this module when the
catalog can answer alone): ``tests/test_import_cost.py`` checks it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from zephon import catalog as catalog_pkg
from zephon.catalog import (
    Catalog,
    CheckpointRecord,
    CheckpointRecordNotFoundError,
    CheckpointState,
    ReplicaRecord,
    RunNotFoundError,
)
from zephon.cli import EXIT_NOT_FOUND, EXIT_OK, render, storage_options, timing
from zephon.cli.render import Column, human_bytes, print_json, print_table, say
from zephon.errors import ConfigError
from zephon.latest import find_latest
from zephon.locations import (
    RunLocation,
    resolve_catalog_url,
    retry_from_env,
    run_location,
    stock_dcp_url,
)
from zephon.storage import (
    MARKER_NAME,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
)

if TYPE_CHECKING:
    from rich.progress import Progress

    from zephon.storage import CheckpointStore

T = TypeVar("T")

EXIT_PROBLEMS = 3
#: work remains that a later run finishes by itself (sysexits' EX_TEMPFAIL): gc deletions held
#: by a claim whose holder this host cannot judge and whose lease has not expired
EXIT_REMAINING = 75

#: what ``zephon checkpoints`` lists without ``--state`` or ``--all``: every row but deleted
LIVE_STATES = [s.value for s in CheckpointState if s is not CheckpointState.DELETED]


def open_catalog(args: argparse.Namespace, *, check_schema: bool = True) -> Catalog:
    return Catalog(resolve_catalog_url(args.catalog), check_schema=check_schema)


def _progress() -> Progress:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=render.console,
        transient=True,
        disable=not render.console.is_terminal,
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
            Column("run", flex=True, priority=1),
            Column("kind", drop=2),
            "status",
            Column("ckpts", numeric=True),
            Column("size", numeric=True),
            Column("latest", numeric=True),
            Column("pending", numeric=True),
            Column("keep", numeric=True),
            Column("stall", numeric=True, drop=1),
            Column("storage", flex=True),
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
                timing.stall(s.latest_timings),
                s.run.storage_url,
            )
            for s in summaries
        ],
        wide=args.wide,
    )
    return EXIT_OK


def _relative(path: str, root: str) -> str:
    prefix = root.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def _trigger(record: CheckpointRecord) -> str | None:
    """What made the save, when not the schedule: ``"emergency"`` for a save on preemption
    (``zephon.emergency``; the checkpoint's metadata says so), else None."""
    trigger = (record.metadata or {}).get("trigger")
    return trigger if isinstance(trigger, str) else None


def _state_shown(record: CheckpointRecord) -> str:
    """The state column: the row's state, marked ``(emergency)`` for a save on preemption."""
    trigger = _trigger(record)
    return f"{record.state} ({trigger})" if trigger else record.state


def cmd_checkpoints(args: argparse.Namespace) -> int:
    states = args.state or (None if args.all else LIVE_STATES)
    with open_catalog(args) as cat:
        record = cat.get_run(args.run)
        rows = cat.list_checkpoints(args.run, states=states)
        copies: dict[int, list[ReplicaRecord]] = {}
        for replica in cat.replicas(args.run):
            copies.setdefault(replica.step, []).append(replica)
        # Steps only a local tier holds (their upload never began) have no checkpoint row;
        # shown unless a --state filter asks for checkpoint states.
        local_only: dict[int, list[ReplicaRecord]] = {}
        if not args.state:
            known = {r.step for r in cat.list_checkpoints(args.run)} if states else None
            local_only = timing.local_only(copies, known or {r.step for r in rows})
    if args.json:
        print_json(
            sorted(
                [
                    {
                        **r.to_dict(),
                        "trigger": _trigger(r),
                        "stock_dcp_url": stock_dcp_url(r.path, r.save_id, r.metadata),
                        "replicas": [c.to_dict() for c in copies.get(r.step, [])],
                    }
                    for r in rows
                ]
                + [
                    {
                        "step": step,
                        "state": timing.LOCAL_ONLY,
                        "replicas": [c.to_dict() for c in held],
                    }
                    for step, held in local_only.items()
                ],
                key=lambda entry: entry["step"],
            )
        )
        return EXIT_OK

    def committed(at: dt.datetime | None) -> str | None:
        if at is None:
            return None
        at = at.astimezone(dt.UTC)
        return at.isoformat(timespec="seconds") if args.wide else at.strftime("%Y-%m-%d %H:%M")

    # a deduplicated save lists more bytes than it stored: "new" shows what it added
    deduplicated = any(r.stored_bytes is not None for r in rows)
    print_table(
        f"checkpoints of run {args.run} in {record.storage_url}",
        [
            Column("step", numeric=True),
            "state",
            Column("epoch", numeric=True, drop=3),
            Column("size", numeric=True),
            *([Column("new", numeric=True)] if deduplicated else []),
            Column("files", numeric=True, drop=4),
            Column("duration", numeric=True),
            Column("MB/s", numeric=True),
            Column("tiers", flex=True, priority=1),
            Column("pin", drop=1),
            Column("committed (UTC)", drop=2),
            Column("path", flex=True),
        ],
        sorted(
            [
                (
                    r.step,
                    _state_shown(r),
                    r.epoch,
                    human_bytes(r.bytes),
                    *([_stored(r)] if deduplicated else []),
                    r.file_count,
                    timing.duration(r.timings),
                    timing.rate(r.bytes, r.timings),
                    timing.tiers(r, copies.get(r.step, ())),
                    "yes" if r.pinned else "",
                    committed(r.committed_at),
                    _relative(r.path, record.storage_url),
                )
                for r in rows
            ]
            + [
                _with_new(timing.local_only_row(step, held, committed), deduplicated)
                for step, held in local_only.items()
            ],
            key=lambda row: row[0],
        ),
        wide=args.wide,
    )
    return EXIT_OK


def _stored(row: CheckpointRecord) -> str:
    """The bytes a save added to storage (all it lists, unless it was deduplicated)."""
    return human_bytes(row.stored_bytes if row.stored_bytes is not None else row.bytes)


def _with_new(row: tuple, deduplicated: bool) -> tuple:
    """A local-only step's row with an empty "new" cell when the table shows that column."""
    return (*row[:4], "", *row[4:]) if deduplicated else row


@contextlib.contextmanager
def located(args: argparse.Namespace) -> Iterator[tuple[RunLocation, Any]]:
    """``(location, catalog or None)`` of ``args.run``, found through the catalog, or by
    scanning ``--save-dir`` without one; the catalog is closed after. ``RunNotFoundError``
    when the catalog has never seen the run."""
    options = storage_options(args)
    if args.save_dir:
        from zephon.storage import CheckpointStore

        store = CheckpointStore(args.save_dir, options, retry=retry_from_env())
        yield RunLocation(args.run or "inference", store, args.run), None
        return
    if not args.run:
        raise ConfigError("name a RUN (from `zephon runs`), or give --save-dir to scan storage")
    with open_catalog(args) as cat:
        # deferred: an answer the catalog gives alone (``zephon latest``) opens no store
        record = cat.get_run(args.run)
        yield run_location(record, options, retry_from_env(), deferred=True), cat


def _nothing_found(args: argparse.Namespace, message: str) -> int:
    """Exit 1 with one line: the run has no complete checkpoint, or is unknown."""
    if args.json:
        print_json(None)
    else:
        say(message)
    return EXIT_NOT_FOUND


def _unknown_run(args: argparse.Namespace, exc: RunNotFoundError) -> int:
    return _nothing_found(
        args,
        f"no checkpoint found: run {exc.run!r} is not in catalog {exc.url}; list runs with "
        f"`zephon runs`, scan storage with `zephon {args.command} {exc.run} --save-dir URL`, "
        "or index it with `zephon sync URL`",
    )


def choose_checkpoint(
    args: argparse.Namespace, action: str
) -> tuple[CheckpointStore, str | None, int] | int:
    """The checkpoint ``args`` name: ``--step``, else the run's latest complete one; when
    there is none (or the catalog never saw the run) the exit code, after saying why."""
    try:
        with located(args) as (location, cat):
            if args.step is not None:
                return location.store, location.storage_run, args.step
            latest = find_latest(location, catalog=cat, confirm=True)
    except RunNotFoundError as exc:
        return _unknown_run(args, exc)
    if latest is None:
        return _nothing_found(
            args, f"no complete checkpoint to {action} for run {args.run or '(inference)'}"
        )
    return location.store, location.storage_run, latest.step


def with_progress(label: str, work: Callable[[Callable[[str], None]], T]) -> T:
    """Run ``work(report)`` under a spinner; ``report(name)`` shows the run being processed."""
    with _progress() as progress:
        task = progress.add_task(label)
        return work(lambda name: progress.update(task, description=f"{label} run {name}"))


def cmd_latest(args: argparse.Namespace) -> int:
    """The full lookup of ``zephon latest`` (``zephon.cli.latest`` tries the catalog's one
    statement first): the catalog's answer, from the catalog alone when it knows the run's
    current attempt; ``--check`` and ``--json`` (which reports the marker's bytes) read and
    check the marker first, setting aside a row storage does not bear out."""
    try:
        with located(args) as (location, cat):
            latest = find_latest(location, catalog=cat, confirm=args.check or args.json)
    except RunNotFoundError as exc:
        return _unknown_run(args, exc)
    if latest is None:
        return _nothing_found(args, f"no complete checkpoint for run {args.run or '(inference)'}")
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
                "stock_dcp_url": stock_dcp_url(
                    latest.url, latest.manifest.payload, latest.manifest.metadata
                ),
            }
        )
    else:
        say(latest.url)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    chosen = choose_checkpoint(args, "verify")
    if isinstance(chosen, int):
        return chosen
    store, storage_run, step = chosen
    try:
        report = store.run(storage_run).verify(step, deep=args.deep)
    except CorruptCheckpointError as exc:
        # A marker that does not parse is what verification exists to find: a problem (3).
        url = store.run(storage_run).checkpoint_url(step)
        problems = [{"file": MARKER_NAME, "kind": "corrupt", "detail": str(exc)}]
        ok, files_checked, bytes_checked, deep = False, 0, 0, args.deep
    else:
        url, ok, deep = report.url, report.ok, report.deep
        files_checked, bytes_checked = report.files_checked, report.bytes_checked
        problems = [{"file": p.name, "kind": p.kind, "detail": p.detail} for p in report.problems]
    if args.json:
        print_json(
            {
                "url": url,
                "step": step,
                "deep": deep,
                "ok": ok,
                "files_checked": files_checked,
                "bytes_checked": bytes_checked,
                "problems": problems,
            }
        )
    elif ok:
        say(
            f"ok: {url}: {files_checked} files, {human_bytes(bytes_checked)} "
            f"{'checksummed' if deep else 'present with the right sizes'}"
        )
    else:
        print_table(
            f"{url} failed verification",
            [Column("file", flex=True), Column("problem", flex=True)],
            [(p["file"], p["detail"]) for p in problems],
            wide=args.wide,
        )
    return EXIT_OK if ok else EXIT_PROBLEMS


def cmd_gc(args: argparse.Namespace) -> int:
    from zephon.gc import GcPolicy, collect_garbage

    options = storage_options(args)
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
                    events_age=None if args.keep_events else args.events_age,
                ),
                dry_run=args.dry_run,
                storage_options=options,
                progress=report_run,
                retry=retry_from_env(),
            ),
        )
    if args.json:
        print_json(report.to_dict())
    else:
        verb = "would delete" if args.dry_run else "deleted"
        for item in report.deleted:
            say(f"{verb} {item['run']} step {item['step']}")
        for item in report.settled:
            say(f"settled unfinished save {item['run']} step {item['step']} -> {item['to']}")
        for item in report.orphans:
            say(f"{'would remove' if args.dry_run else 'removed'} orphan {item['url']}")
        for problem in report.problems:
            say(f"problem: {problem}")
        remaining = report.remaining_line()
        if remaining is not None:
            say(remaining)
        say(
            f"gc{' (dry run)' if args.dry_run else ''}: {len(report.deleted)} checkpoint(s), "
            f"{len(report.orphans)} orphan(s), {len(report.settled)} unfinished save(s) settled, "
            f"{len(report.problems)} problem(s)"
            + (
                f", {report.events_pruned} old event(s) pruned"
                if report.events_pruned is not None
                else ""
            )
        )
    if report.problems:
        return EXIT_PROBLEMS
    return EXIT_REMAINING if report.remaining and not args.dry_run else EXIT_OK


def _require_directory(url: str, options: dict[str, Any]) -> None:
    """Refuse a storage URL with nothing there: syncing it would report "0 runs", true of
    any typo."""
    from zephon.storage import CheckpointStore, is_dir

    location = CheckpointStore(url, options, retry=retry_from_env()).location
    found = is_dir(location, location.root)
    if not found:
        raise StorageError(
            f"{location.url} is no directory or bucket that exists, so there is nothing to "
            "sync; check the URL (and the endpoint in --storage-options)",
            url=location.url,
        )


def cmd_sync(args: argparse.Namespace) -> int:
    from zephon.sync import sync_storage

    options = storage_options(args)
    _require_directory(args.url, options)
    with open_catalog(args) as cat:
        report = with_progress(
            "sync",
            lambda report_run: sync_storage(
                cat,
                args.url,
                options,
                inference_name=args.inference_name,
                progress=report_run,
                retry=retry_from_env(),
            ),
        )
    if args.json:
        print_json(report.to_dict())
    else:
        counts = ", ".join(f"{v} {k}" for k, v in sorted(report.outcomes.items())) or "nothing"
        say(
            f"synced {len(report.runs)} run(s) from {report.url}: {counts}; "
            f"{len(report.marked_missing)} marked missing"
        )
        for problem in report.problems:
            say(f"problem: {problem}")
    return EXIT_PROBLEMS if report.problems else EXIT_OK


def cmd_pin(args: argparse.Namespace) -> int:
    with open_catalog(args) as cat:
        try:
            row = cat.pin(args.run, args.step) if args.pin else cat.unpin(args.run, args.step)
        except CheckpointRecordNotFoundError as exc:
            # no such checkpoint: the one error for it (exit 4), the catalog's row as its cause
            raise CheckpointNotFoundError(str(exc), run=exc.run, step=exc.step) from exc
    if args.json:
        print_json(row.to_dict())
    else:
        say(f"{'pinned' if row.pinned else 'unpinned'} {row.run} step {row.step}")
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
        say(message)
    return EXIT_OK
