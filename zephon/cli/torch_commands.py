"""Subcommands that handle tensors (export, adopt, demo); torch is imported only when they
run."""

from __future__ import annotations

import argparse

from zephon.cli import (
    count_between,
    parse_run,
    parse_size,
    parse_step,
    parse_storage_options,
)
from zephon.cli.render import human_bytes, print_json, print_table, say
from zephon.errors import ConfigError

#: ``zephon demo`` starts this many processes at most (one per rank, on one machine)
MAX_DEMO_RANKS = 64
MAX_DEMO_STEPS = 1_000_000


def cmd_export(args: argparse.Namespace) -> int:
    from zephon.checkpointing import export_safetensors
    from zephon.cli.commands import choose_checkpoint, storage_options

    chosen = choose_checkpoint(args, "export")
    if isinstance(chosen, int):
        return chosen
    store, storage_run, step = chosen
    result = export_safetensors(
        store,
        storage_run,
        step,
        args.out,
        key=args.key,
        max_shard_bytes=args.max_shard_size,
        source_checkpoint=args.source,
        storage_options=storage_options(args),
    )
    if args.json:
        print_json(
            {
                "directory": result.directory,
                "files": result.files,
                "step": result.step,
                "tensors": result.tensors,
                "total_bytes": result.total_bytes,
            }
        )
    else:
        say(
            f"exported step {result.step}: {result.tensors} tensors, "
            f"{human_bytes(result.total_bytes)} in {len(result.files) - 1} file(s) "
            f"to {result.directory}"
        )
    return 0


def cmd_adopt(args: argparse.Namespace) -> int:
    from zephon.adopt import adopt
    from zephon.cli.commands import open_catalog, storage_options, with_progress

    options = storage_options(args)
    with open_catalog(args) as cat:
        report = with_progress(
            "adopt",
            lambda report_step: adopt(
                args.source,
                args.run_url,
                step=args.step,
                catalog=cat,
                storage_options=options,
                source_options=args.source_options,
                progress=report_step,
            ),
        )
    if args.json:
        print_json(report.to_dict())
        return 0
    for done in report.steps:
        if done.skipped is not None:
            say(f"skipped step {done.step}: {done.skipped} ({done.url})")
        else:
            where = " (copied on the server)" if done.copied_on_server else ""
            say(
                f"adopted step {done.step} from {done.source}: {done.items} items, "
                f"{done.files} file(s), {human_bytes(done.bytes)}{where} -> {done.url}"
            )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from zephon.cli.commands import storage_options
    from zephon.demo import run_demo

    if args.ranks < 1 or args.steps < 4 or not 1 <= args.kill_after < args.steps:
        raise ConfigError("demo needs --ranks >= 1, --steps >= 4 and 1 <= --kill-after < --steps")
    result = run_demo(
        work_dir=args.work_dir,
        save_dir=args.save_dir,
        catalog_url=args.catalog,
        storage_options=storage_options(args),
        ranks=args.ranks,
        steps=args.steps,
        kill_after=args.kill_after,
        say=(lambda _: None) if args.json else say,
    )
    if args.json:
        print_json(
            {
                "identical": result.identical,
                "resumed_from": result.resumed_from,
                "killed_after": result.killed_after,
                "seconds": round(result.seconds, 1),
                "work_dir": result.work_dir,
                "losses": {
                    s: {"uninterrupted": a, "resumed": b} for s, (a, b) in result.compared.items()
                },
            }
        )
    else:
        print_table(
            "losses of rank 0 after the resume",
            ["step", "uninterrupted", "resumed", "equal"],
            [
                (s, repr(a), repr(b), "yes" if a == b else "NO")
                for s, (a, b) in result.compared.items()
            ],
        )
        verdict = "bit for bit equal" if result.identical else "DIFFERENT"
        say(
            f"resumed run vs uninterrupted run: {verdict} "
            f"({len(result.compared)} steps compared, {result.seconds:.0f} s)"
        )
        say(f"inspect it: zephon runs --catalog {result.catalog_url}")
    return 0 if result.identical else 3


def register(add) -> None:
    p = add("export", cmd_export, "export a checkpoint's model as .safetensors files")
    p.add_argument(
        "run", nargs="?", type=parse_run, help="run name (omit with --save-dir for inference)"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="new directory for the files")
    p.add_argument("--step", type=parse_step, help="step to export (default: the latest)")
    p.add_argument("--save-dir", metavar="URL", help="find the run here instead of the catalog")
    p.add_argument("--key", default="model", help="the model entry to export (default: model)")
    p.add_argument(
        "--source", metavar="URL", help="base model for a checkpoint of trainable parameters only"
    )
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size("5GB"),
        help="start a new file above this size (default 5GB)",
    )

    p = add("adopt", cmd_adopt, "bring stock torch DCP checkpoints into a Zephon run")
    p.add_argument(
        "source",
        help="a stock DCP checkpoint directory (torch's FileSystemWriter), or a directory of "
        "step-N ones (torchtitan's layout)",
    )
    p.add_argument("run_url", metavar="run_url", help="the run's URL, <save_dir>/<run>")
    p.add_argument(
        "--step", type=parse_step, help="the step a single checkpoint becomes (not for step-N)"
    )
    p.add_argument(
        "--source-options",
        metavar="JSON",
        type=parse_storage_options,
        help="fsspec storage options of the source (default: the run's, if both URLs have "
        "the same protocol)",
    )

    p = add("demo", cmd_demo, "train, get preempted (SIGKILL), resume, compare the losses")
    p.add_argument(
        "--work-dir",
        help="where logs (and by default checkpoints) go (default: a new temporary directory)",
    )
    p.add_argument("--save-dir", metavar="URL", help="checkpoint URL, e.g. s3://bucket/demo")
    p.add_argument(
        "--ranks",
        type=count_between(1, MAX_DEMO_RANKS),
        default=2,
        help="data-parallel processes (default 2)",
    )
    p.add_argument(
        "--steps",
        type=count_between(4, MAX_DEMO_STEPS),
        default=24,
        help="total training steps (default 24)",
    )
    p.add_argument(
        "--kill-after",
        type=count_between(1, MAX_DEMO_STEPS - 1),
        default=14,
        help="SIGKILL the job once this step is done (default 14)",
    )
