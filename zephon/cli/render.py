"""Output for the command line: tables and lines for people, JSON for programs (``--json``).

A table fits the terminal (``console.width``): every row is one line, numbers and short values
are shown whole, and long text (names, URLs, paths: columns made with ``flex=True``) is
shortened in the middle, where a path says least (``s3://bucket/…/run``); columns made with
``drop=N`` are details left out, highest ``N`` first, when the table would not fit otherwise.
``wide=True`` (``--wide``) shows every column and every value whole and lets lines run as long
as they need. Text from
storage or the catalog is printed literally: no rich markup or emoji codes are interpreted, and
control characters are escaped so that nothing can break a line or move the cursor.

rich is imported when a table is printed, not with this module: a plain line (``say``, what
``zephon latest`` prints) is written as is, so the quick commands do not load it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "Column",
    "console",  # noqa: F822 - made on first use (__getattr__)
    "human_bytes",
    "human_rate",
    "human_seconds",
    "print_json",
    "print_table",
    "say",
    "shorten",
]

# ``console``: a module attribute read at each call, so a test can swap in a Console of a chosen
# width. Made on first use (``__getattr__``, and ``_console()`` inside this module).


def _console() -> Console:
    console = globals().get("console")
    if console is None:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
        globals()["console"] = console
    return console


def __getattr__(name: str) -> Any:
    if name == "console":
        return _console()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cell_len(text: str) -> int:
    """The terminal cells ``text`` takes (wide characters take two): rich's measure."""
    from rich.cells import cell_len as cells

    return cells(text)


ELLIPSIS = "…"
#: a shortened value keeps at least this many cells (or its header's width, if wider)
MIN_FLEX_WIDTH = 10
_GAP = "  "


@dataclass(frozen=True, slots=True)
class Column:
    """A table column: ``numeric`` ones are right-aligned; only ``flex`` ones are shortened,
    those of a lower ``priority`` first (a run's name outlasts its storage URL). A column with
    ``drop`` (1, 2, ...) is a detail: left out, highest ``drop`` first, while the table does
    not fit the terminal with every flex column at its floor (``--wide`` keeps it)."""

    header: str
    numeric: bool = False
    flex: bool = False
    priority: int = 0
    drop: int = 0


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def human_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


def human_seconds(value: float | None) -> str:
    """``0.42s``, ``12.3s``, ``2m03s``, ``1h02m``; ``-`` for None (not timed)."""
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.2f}s"
    if value < 60:
        return f"{value:.1f}s"
    minutes, seconds = divmod(round(value), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def human_rate(size: int | None, seconds: float | None) -> str:
    """Megabytes (10**6 bytes) per second, 3 significant digits or whole; ``-`` when either
    is unknown or the time is 0."""
    if size is None or not seconds:
        return "-"
    rate = size / seconds / 1e6
    if rate >= 100:
        return f"{rate:.0f}"
    return f"{rate:.1f}" if rate >= 10 else f"{rate:.2f}"


def printable(value: object) -> str:
    """``value`` as one line of literal text: line breaks become spaces, other control
    characters their escape (``\\x1b``), so nothing from storage can move the cursor."""
    text = " ".join(str(value).splitlines())
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def say(message: object, *, bold: bool = False) -> None:
    """Print one line to stdout as is (never wrapped, never interpreted); a bold one through
    the console (bold on a terminal, plain elsewhere)."""
    if not bold:
        sys.stdout.write(printable(message) + "\n")
        return
    from rich.text import Text

    _console().print(Text(printable(message), style="bold"), soft_wrap=True)


def shorten(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, cut in the middle: a path or URL keeps whole
    components on both sides of the ``…`` (``s3://bucket/…/run``) when that loses little,
    anything else keeps its head and tail."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    aligned = _shorten_path(text, width)
    # A component-aligned cut is clearer, but not when it throws most of the room away.
    if aligned is not None and 3 * cell_len(aligned) >= 2 * width:
        return aligned
    keep = width - 1
    head, tail = (keep + 1) // 2, keep // 2
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def _shorten_path(text: str, width: int) -> str | None:
    scheme, sep, rest = text.partition("://")
    prefix, body = (scheme + sep, rest) if sep else ("", text)
    parts = body.split("/")
    best: str | None = None
    for tail_count in range(1, len(parts) - 1):
        tail = "/".join(parts[-tail_count:])
        for head_count in range(len(parts) - 1 - tail_count, 0, -1):
            candidate = f"{prefix}{'/'.join(parts[:head_count])}/{ELLIPSIS}/{tail}"
            if cell_len(candidate) <= width:
                if best is None or cell_len(candidate) > cell_len(best):
                    best = candidate
                break
    return best


def _fit(natural: list[int], columns: Sequence[Column], room: int) -> list[int]:
    """Column widths that fit ``room`` cells: the widest flex column of the lowest priority
    gives up a cell at a time, down to its floor; fixed columns never shrink (if they alone do
    not fit, the lines run long rather than a number being cut)."""
    widths = list(natural)
    floors = [
        min(natural[i], max(MIN_FLEX_WIDTH, cell_len(c.header))) if c.flex else natural[i]
        for i, c in enumerate(columns)
    ]
    while sum(widths) > room:
        shrinkable = [i for i in range(len(widths)) if widths[i] > floors[i]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: (-columns[i].priority, widths[i]))
        widths[widest] -= 1
    return widths


def print_table(
    title: str,
    columns: Sequence[Column | str],
    rows: Iterable[Sequence[Any]],
    *,
    wide: bool = False,
) -> None:
    """A title line, a bold header line and one line per row (``None`` cells print ``-``)."""
    cols = [c if isinstance(c, Column) else Column(c) for c in columns]
    cells = [["-" if v is None else printable(v) for v in row] for row in rows]
    width = _console().width
    if not wide:
        cols, cells = _drop_details(cols, cells, width)
    natural = [
        max([cell_len(c.header)] + [cell_len(row[i]) for row in cells]) for i, c in enumerate(cols)
    ]
    widths = natural
    if not wide:
        widths = _fit(natural, cols, width - len(_GAP) * (len(cols) - 1))
        title = shorten(printable(title), width)
        cells = [
            [shorten(v, widths[i]) if cols[i].flex else v for i, v in enumerate(row)]
            for row in cells
        ]
    say(title)
    say(_line([c.header for c in cols], cols, widths), bold=True)
    for row in cells:
        say(_line(row, cols, widths))


def _drop_details(
    cols: list[Column], cells: list[list[str]], width: int
) -> tuple[list[Column], list[list[str]]]:
    """Leave out detail columns (``drop``), highest first, until the narrowest layout fits."""

    def narrowest(kept: list[int]) -> int:
        total = len(_GAP) * (len(kept) - 1)
        for i in kept:
            natural = max([cell_len(cols[i].header)] + [cell_len(row[i]) for row in cells])
            floor = max(MIN_FLEX_WIDTH, cell_len(cols[i].header))
            total += min(natural, floor) if cols[i].flex else natural
        return total

    kept = list(range(len(cols)))
    for drop in sorted({c.drop for c in cols if c.drop}, reverse=True):
        if narrowest(kept) <= width:
            break
        kept = [i for i in kept if cols[i].drop != drop]
    return [cols[i] for i in kept], [[row[i] for i in kept] for row in cells]


def _line(values: Sequence[str], cols: Sequence[Column], widths: Sequence[int]) -> str:
    padded = []
    for value, col, size in zip(values, cols, widths, strict=True):
        fill = " " * max(0, size - cell_len(value))
        padded.append(fill + value if col.numeric else value + fill)
    return _GAP.join(padded).rstrip()
