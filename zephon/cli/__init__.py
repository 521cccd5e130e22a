"""The ``zephon`` command: catalog queries, retention for cron, verify, sync, export, demo.

Every error becomes one line on stderr and a documented exit code, never a traceback:

====  ===========================================================
0     success
1     nothing found (``latest``/``verify`` with no complete checkpoint)
2     bad usage (unknown command, invalid option value)
3     problems found (verification failed, gc or sync could not finish a run)
4     storage error (unreachable, permission, corrupt checkpoint)
5     catalog error (unreachable database, outdated schema, unknown run)
6     other Zephon error (invalid configuration, torch-side errors)
70    internal error (a bug; ``ZEPHON_DEBUG=1`` shows the traceback)
130   interrupted
====  ===========================================================
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from catalog import CatalogError
from storage import StorageError
from zephon.errors import ZephonError

__all__ = ["main", "build_parser"]

EXIT_USAGE = 2
EXIT_STORAGE = 4
EXIT_CATALOG = 5
EXIT_ZEPHON = 6
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130


def parse_step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid step {text!r}: use a non-negative integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    from zephon.cli import commands as c

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--catalog",
        metavar="URL",
        help="catalog database URL (default: $ZEPHON_CATALOG_URL, else a SQLite file in the "
        "user data directory)",
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    common.add_argument(
        "--storage-options",
        metavar="JSON",
        help="fsspec storage options as JSON (default: $ZEPHON_STORAGE_OPTIONS)",
    )

    parser = argparse.ArgumentParser(
        prog="zephon",
        description="Zephon: checkpoints on any storage, a catalog of runs, exact resumption.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, handler, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    add("runs", c.cmd_runs, "list runs with their checkpoint counts and sizes")

    p = add("checkpoints", c.cmd_checkpoints, "list the checkpoints of a run")
    p.add_argument("run")
    p.add_argument(
        "--state",
        action="append",
        choices=["pending", "committed", "deleting", "deleted", "failed"],
        help="only these states (repeatable)",
    )

    for name, handler, text in (
        ("latest", c.cmd_latest, "print the URL of a run's latest complete checkpoint"),
        ("verify", c.cmd_verify, "check a checkpoint's files against its manifest"),
    ):
        p = add(name, handler, text)
        p.add_argument("run", nargs="?", help="run name (omit with --save-dir for inference)")
        p.add_argument(
            "--save-dir", metavar="URL", help="scan this storage URL instead of the catalog"
        )
        if name == "verify":
            p.add_argument("--step", type=parse_step, help="step to verify (default: the latest)")
            p.add_argument("--deep", action="store_true", help="also check every CRC32C")

    p = add("gc", c.cmd_gc, "apply retention, finish interrupted deletes, remove orphans")
    p.add_argument("--run", action="append", help="only this run (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="report, change nothing")
    p.add_argument(
        "--grace",
        type=c.parse_duration,
        default=c.parse_duration("24h"),
        help="leave leftovers of unfinished saves and abandoned (stale) checkpoints younger "
        "than this alone (default 24h); a save in progress is protected whatever it says",
    )
    p.add_argument(
        "--pending-grace",
        type=c.parse_duration,
        default=c.parse_duration("24h"),
        help="a save that has not committed after this long is settled as failed "
        "(default 24h); keep it above the longest save",
    )
    p.add_argument(
        "--corrupt",
        action="store_true",
        help="also delete checkpoints that failed verification (kept for inspection otherwise)",
    )
    p.add_argument(
        "--lease",
        type=c.parse_duration,
        default=c.parse_duration("1h"),
        help="take over deletions another gc claimed longer ago than this (default 1h)",
    )

    p = add("sync", c.cmd_sync, "index a storage URL's runs and checkpoints into the catalog")
    p.add_argument("url")
    p.add_argument("--inference-name", help="catalog name for an inference layout at URL")

    for name, pin in (("pin", True), ("unpin", False)):
        p = add(
            name, c.cmd_pin, f"{name} a checkpoint so retention {'keeps' if pin else 'decides'} it"
        )
        p.add_argument("run")
        p.add_argument("step", type=parse_step)
        p.set_defaults(pin=pin)

    p = add("db", c.cmd_db, "manage the catalog schema")
    p.add_argument("db_command", choices=["upgrade", "current"])

    _add_torch_commands(add)
    return parser


def _add_torch_commands(add) -> None:
    """Subcommands that need torch register here; their modules import it lazily."""
    try:
        from zephon.cli import torch_commands
    except ImportError:  # pragma: no cover - the module ships with zephon
        return
    torch_commands.register(add)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        _fail("interrupted")
        return EXIT_INTERRUPTED
    except StorageError as exc:
        return _fail(exc, EXIT_STORAGE)
    except CatalogError as exc:
        return _fail(exc, EXIT_CATALOG)
    except ZephonError as exc:
        return _fail(exc, EXIT_ZEPHON)
    except ValueError as exc:  # invalid values from layers below that are not yet wrapped
        return _fail(exc, EXIT_USAGE)
    except Exception as exc:  # a bug: still one line, with a way to see the traceback
        if os.environ.get("ZEPHON_DEBUG"):
            raise
        return _fail(
            f"unexpected {type(exc).__name__}: {exc} (a bug in zephon: run again with "
            "ZEPHON_DEBUG=1 for the traceback and report it)",
            EXIT_INTERNAL,
        )


def _fail(message: object, code: int = EXIT_ZEPHON) -> int:
    text = " ".join(str(message).split())
    sys.stderr.write(f"zephon: error: {text}\n")
    return code


def entry_point() -> None:
    sys.exit(main())
