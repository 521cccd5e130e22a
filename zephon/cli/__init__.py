"""The ``zephon`` command: catalog queries, retention for cron, verify, sync, export, adopt, demo.

Every error becomes one line on stderr and a documented exit code, never a traceback:

====  ===========================================================
0     success
1     nothing found (``latest``/``verify``/``export``: the run has no complete checkpoint,
      or the catalog has never seen the run)
2     bad usage (unknown command, invalid or out-of-range option value)
3     problems found (verification failed, gc or sync could not finish a run)
4     storage error (unreachable, permission, rejected storage options, a URL that does not
      exist, a corrupt checkpoint)
5     catalog error (unreachable database, outdated schema, unknown run for ``checkpoints``,
      ``pin`` and ``goodput``)
6     other Zephon error (invalid configuration, torch-side errors)
70    internal error (a bug; ``ZEPHON_DEBUG=1`` shows the traceback)
75    not finished yet (``gc``: deletions another process claimed, which this host cannot
      tell alive or dead, wait for their lease; the line names them and when it expires)
130   interrupted
====  ===========================================================

Option values are checked where they are parsed (exit 2, naming the option and what it
accepts), so a value that cannot work never reaches the layers below: steps fit the catalog's
64-bit integers, durations and sizes are bounded, ``--storage-options`` is a JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from zephon.catalog import CatalogError
from zephon.errors import ConfigError, ZephonError
from zephon.storage import MAX_STEP, StorageError, parse_number, validate_run

__all__ = ["main", "build_parser", "storage_options"]

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_STORAGE = 4
EXIT_CATALOG = 5
EXIT_ZEPHON = 6
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

#: no retention duration is longer than this; a longer one is a slip (and overflows dates)
MAX_DURATION = dt.timedelta(days=3650)
#: no file is larger than this (1 PiB: the manifest refuses larger sizes as damage)
MAX_SIZE = 1 << 50

_DURATION = re.compile(r"([0-9]{1,12}(?:\.[0-9]{1,9})?)\s*([smhdw]?)")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE = re.compile(r"([0-9]{1,16}(?:\.[0-9]{1,9})?)\s*([kmgtp]?i?b?)", re.IGNORECASE)
_SIZE_FACTORS = {
    "": 1,
    "b": 1,
    **{f"{p}{suffix}": 1000**n for n, p in enumerate("kmgtp", 1) for suffix in ("", "b")},
    **{f"{p}ib": 1024**n for n, p in enumerate("kmgtp", 1)},
}
_STORAGE_OPTIONS_EXAMPLE = '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}'


def _shown(text: str) -> str:
    """``text`` quoted for a message, shortened: a megabyte of input still gives one line."""
    return repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text):,} characters)"


def parse_step(text: str) -> int:
    """A step: an integer from 0 to ``MAX_STEP`` (every step argument and option)."""
    step = parse_number(text.strip())
    if step is None:
        raise argparse.ArgumentTypeError(
            f"invalid step {_shown(text)}: use an integer from 0 to {MAX_STEP}"
        )
    return step


def parse_run(text: str) -> str:
    """A run name as storage and the catalog accept it (every run argument and option)."""
    if len(text) > 128:
        raise argparse.ArgumentTypeError(
            f"invalid run name {_shown(text)}: use at most 128 characters of A-Z a-z 0-9 . _ -"
        )
    try:
        return validate_run(text)  # type: ignore[return-value]
    except StorageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(text: str, *, positive: bool) -> dt.timedelta:
    match = _DURATION.fullmatch(text.strip())
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)] if match else -1.0
    too_small = seconds <= 0 if positive else seconds < 0
    if too_small or seconds > MAX_DURATION.total_seconds():
        raise argparse.ArgumentTypeError(
            f"invalid duration {_shown(text)}: use a number with an optional unit s, m, h, d "
            f"or w, {'more than 0' if positive else 'from 0'} up to {MAX_DURATION.days}d "
            "(10 years), e.g. 24h or 30m"
        )
    return dt.timedelta(seconds=seconds)


def parse_duration(text: str) -> dt.timedelta:
    """``90``, ``90s``, ``30m``, ``24h``, ``7d`` or ``2w``: from 0 up to ``MAX_DURATION``."""
    return _duration(text, positive=False)


def parse_positive_duration(text: str) -> dt.timedelta:
    """A duration longer than 0 (a lease: gc refuses 0, which would take over every claim)."""
    return _duration(text, positive=True)


def parse_size(text: str) -> int:
    """``5GB``, ``500MiB``, ``1000000``: from 1 byte up to ``MAX_SIZE`` (1 PiB)."""
    match = _SIZE.fullmatch(text.strip())
    factor = _SIZE_FACTORS.get(match.group(2).lower()) if match else None
    value = int(float(match.group(1)) * factor) if match and factor else 0
    if not 1 <= value <= MAX_SIZE:
        raise argparse.ArgumentTypeError(
            f"invalid size {_shown(text)}: use a number with an optional unit (KB, MB, GB, TB "
            "or KiB, MiB, GiB, TiB), from 1 byte up to 1PiB, e.g. 5GB or 500MiB"
        )
    return value


def count_between(low: int, high: int) -> Callable[[str], int]:
    """A parser of integers from ``low`` to ``high`` (``--ranks``, ``--steps``)."""

    def parse_count(text: str) -> int:
        digits = text.strip()
        if not re.fullmatch(r"[0-9]{1,12}", digits) or not low <= int(digits) <= high:
            raise argparse.ArgumentTypeError(
                f"invalid number {_shown(text)}: use an integer from {low} to {high}"
            )
        return int(digits)

    return parse_count


def parse_storage_options(text: str) -> dict:
    """``--storage-options``: a JSON object of fsspec options."""
    return storage_options_object(text, "the value", argparse.ArgumentTypeError)


def storage_options(args: argparse.Namespace) -> dict:
    """``--storage-options`` (parsed by the parser), else ``$ZEPHON_STORAGE_OPTIONS``."""
    from zephon.locations import STORAGE_OPTIONS_ENV

    if args.storage_options is not None:
        return dict(args.storage_options)
    text = os.environ.get(STORAGE_OPTIONS_ENV)
    if not text:
        return {}
    return storage_options_object(text, f"${STORAGE_OPTIONS_ENV}", ConfigError)


def storage_options_object(text: str, source: str, error: Callable[[str], Exception]) -> dict:
    """The JSON object in ``text`` (from ``source``), or ``error(message)`` naming the fix."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(
            f"{source} is not valid JSON ({exc.msg} at character {exc.pos}); give an object "
            f"such as {_STORAGE_OPTIONS_EXAMPLE}"
        ) from None
    except (RecursionError, ValueError):  # nesting beyond the parser's stack; a 5000-digit int
        raise error(
            f"{source} nests too deeply or holds a number too long to read; give a small JSON "
            f"object such as {_STORAGE_OPTIONS_EXAMPLE}"
        ) from None
    if not isinstance(value, dict):
        # not the text itself: a string or list of credentials has no key names to mask by
        raise error(
            f"{source} must be a JSON object of fsspec options, got a JSON "
            f"{type(value).__name__}; give an object such as {_STORAGE_OPTIONS_EXAMPLE}"
        )
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as the one ``zephon: error:`` line every error is."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{message}; see `{self.prog} --help`", EXIT_USAGE)
        self.exit(EXIT_USAGE)


def _common(*, top: bool) -> argparse.ArgumentParser:
    """The options every command takes, before the command (``zephon --json runs``) or after
    it. The subcommands' copies default to SUPPRESS: argparse would otherwise overwrite a
    value given before the command with the subcommand's default."""
    unset = None if top else argparse.SUPPRESS
    common = _Parser(add_help=False)
    common.add_argument(
        "--catalog",
        metavar="URL",
        default=unset,
        help="catalog database URL (default: $ZEPHON_CATALOG_URL, else a SQLite file in the "
        "user data directory)",
    )
    common.add_argument(
        "--json",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="print JSON instead of tables",
    )
    common.add_argument(
        "--storage-options",
        metavar="JSON",
        type=parse_storage_options,
        default=unset,
        help="fsspec storage options as a JSON object (default: $ZEPHON_STORAGE_OPTIONS)",
    )
    return common


def _add_wide(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wide",
        action="store_true",
        help="show every value whole (tables otherwise fit the terminal, long values "
        "shortened in the middle)",
    )


def _command(name: str, module: str = "zephon.cli.commands") -> Callable[[argparse.Namespace], int]:
    """The handler ``<module>.<name>``, imported when the command runs: building the parser
    (``zephon --help``, a usage error) loads nothing the commands use (the catalog, storage
    backends, rich)."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), name)(args)

    run.__name__ = run.__qualname__ = name
    return run


def build_parser() -> argparse.ArgumentParser:
    from zephon.catalog import CheckpointState
    from zephon.cli.boundary import at_boundary

    common = _common(top=False)
    parser = _Parser(
        prog="zephon",
        description="Zephon: checkpoints on any storage, a catalog of runs, exact resumption.",
        parents=[_common(top=True)],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, handler, help_text: str) -> argparse.ArgumentParser:
        """A subcommand; ``handler``: a function, or the name of one in ``zephon.cli.commands``
        (imported when the command runs)."""
        if isinstance(handler, str):
            handler = _command(handler)
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        # What the layers below raise on purpose prints as one line (zephon.cli.boundary).
        p.set_defaults(handler=at_boundary(handler))
        return p

    p = add("runs", "cmd_runs", "list runs with their checkpoint counts and sizes")
    _add_wide(p)

    p = add("checkpoints", "cmd_checkpoints", "list the checkpoints of a run")
    p.add_argument("run", type=parse_run)
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--state",
        action="append",
        choices=[state.value for state in CheckpointState],
        help="only these states (repeatable; default: every state but deleted)",
    )
    which.add_argument("--all", action="store_true", help="also list deleted checkpoints")
    _add_wide(p)

    for name, handler, text in (
        (
            "latest",
            # first the catalog's answer without the ORM (zephon.cli.latest), else the full one
            _command("cmd_latest", "zephon.cli.latest"),
            "print the URL of a run's latest complete checkpoint",
        ),
        ("verify", "cmd_verify", "check a checkpoint's files against its manifest"),
    ):
        p = add(name, handler, text)
        p.add_argument(
            "run", nargs="?", type=parse_run, help="run name (omit with --save-dir for inference)"
        )
        p.add_argument(
            "--save-dir", metavar="URL", help="scan this storage URL instead of the catalog"
        )
        if name == "latest":
            p.add_argument(
                "--check",
                action="store_true",
                help="read and check its commit marker before answering (--json does too); "
                "without it the catalog answers alone",
            )
        if name == "verify":
            p.add_argument("--step", type=parse_step, help="step to verify (default: the latest)")
            p.add_argument("--deep", action="store_true", help="also check every CRC32C")
            _add_wide(p)

    p = add("gc", "cmd_gc", "apply retention, finish interrupted deletes, remove orphans")
    p.add_argument("--run", action="append", type=parse_run, help="only this run (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="report, change nothing")
    p.add_argument(
        "--grace",
        type=parse_duration,
        default=parse_duration("24h"),
        help="leave leftovers of unfinished saves and abandoned (stale) checkpoints younger "
        "than this alone (default 24h); a save in progress is protected whatever it says",
    )
    p.add_argument(
        "--pending-grace",
        type=parse_duration,
        default=parse_duration("24h"),
        help="a save that has not committed after this long is settled as failed "
        "(default 24h); keep it above the longest save",
    )
    p.add_argument(
        "--corrupt",
        action="store_true",
        help="also delete checkpoints that failed verification (kept for inspection otherwise)",
    )
    p.add_argument(
        "--events-age",
        type=parse_positive_duration,
        default=parse_duration("90d"),
        help="prune audit events older than this (default 90d; a pass over every run only)",
    )
    p.add_argument("--keep-events", action="store_true", help="do not prune audit events this pass")
    p.add_argument(
        "--lease",
        type=parse_positive_duration,
        default=parse_positive_duration("1h"),
        help="take over deletions another gc claimed longer ago than this (default 1h; more "
        "than 0); those of a gc that failed, or exited on this host, are taken over at once",
    )

    p = add("sync", "cmd_sync", "index a storage URL's runs and checkpoints into the catalog")
    p.add_argument("url")
    p.add_argument(
        "--inference-name", type=parse_run, help="catalog name for an inference layout at URL"
    )

    for name, pin in (("pin", True), ("unpin", False)):
        p = add(
            name, "cmd_pin", f"{name} a checkpoint so retention {'keeps' if pin else 'decides'} it"
        )
        p.add_argument("run", type=parse_run)
        p.add_argument("step", type=parse_step)
        p.set_defaults(pin=pin)

    p = add(
        "goodput",
        _command("cmd_goodput", "zephon.cli.goodput"),
        "report a run's goodput: productive time, time lost to restarts, checkpoint stall",
    )
    p.add_argument("run", type=parse_run)

    p = add("db", "cmd_db", "manage the catalog schema")
    p.add_argument("db_command", choices=["upgrade", "current"])

    from zephon.cli import ui as ui_command

    ui_command.register(add)
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
    # Every line printed on error is redacted here once more (defence in depth): the layers mask
    # what they know of, this also scrubs whatever credential the user typed or exported.
    import contextlib
    import io

    from zephon.locations import known_secrets
    from zephon.storage import redact

    argv = list(sys.argv[1:] if argv is None else argv)
    secrets = known_secrets(argv)
    ui_token = os.environ.get("ZEPHON_UI_TOKEN", "")  # zephon ui --allow-remote's secret
    if ui_token:
        secrets |= {ui_token}
    parser = build_parser()
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            args = parser.parse_args(argv)
    finally:
        # argparse quotes the offending argument, which may be a URL with a password
        if usage.getvalue():
            sys.stderr.write(redact(usage.getvalue(), secrets))
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        _fail("interrupted")
        return EXIT_INTERRUPTED
    except StorageError as exc:
        return _fail(exc, EXIT_STORAGE, secrets)
    except CatalogError as exc:
        return _fail(exc, EXIT_CATALOG, secrets)
    except ZephonError as exc:
        return _fail(exc, EXIT_ZEPHON, secrets)
    except ValueError as exc:  # invalid values from layers below that are not yet wrapped
        return _fail(exc, EXIT_USAGE, secrets)
    except Exception as exc:  # a bug: still one line, with a way to see the traceback
        if os.environ.get("ZEPHON_DEBUG"):
            raise
        return _fail(
            f"unexpected {type(exc).__name__}: {exc} (a bug in zephon: run again with "
            "ZEPHON_DEBUG=1 for the traceback and report it)",
            EXIT_INTERNAL,
            secrets,
        )


def _fail(message: object, code: int = EXIT_ZEPHON, secrets: frozenset[str] = frozenset()) -> int:
    """Print ``message`` as the one ``zephon: error:`` line, credentials masked (``secrets``:
    the literal values to scrub besides what ``storage.redact.redact`` recognises)."""
    from zephon.storage import redact

    text = " ".join(redact(message, secrets).split())
    sys.stderr.write(f"zephon: error: {text}\n")
    return code


def entry_point() -> None:
    sys.exit(main())
