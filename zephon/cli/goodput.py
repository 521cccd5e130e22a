"""``zephon goodput RUN``: how much of a run's wall time trained, from the catalog alone
(``zephon.goodput``; docs/goodput.md defines each figure). Imports neither torch nor storage."""

from __future__ import annotations

import argparse

from zephon.catalog import Catalog
from zephon.cli import EXIT_OK
from zephon.cli.render import human_seconds, print_json, say
from zephon.goodput import Goodput, from_catalog
from zephon.locations import resolve_catalog_url

__all__ = ["cmd_goodput", "lines"]


def lines(figures: Goodput) -> list[str]:
    """The plain-text report: one figure a line, seconds and share of the wall time."""
    wall = figures.wall_s

    def share(seconds: float) -> str:
        return f"{100 * seconds / wall:5.1f}%" if wall > 0 else "    -"

    period = (
        f"{figures.started_at.isoformat(timespec='seconds')} .. "
        f"{figures.ended_at.isoformat(timespec='seconds')}"
        if figures.started_at is not None and figures.ended_at is not None
        else "no attempt recorded"
    )
    rows = [
        ("productive", figures.productive_s),
        ("lost to restarts", figures.lost_s),
        ("restart overhead", figures.overhead_s),
        ("checkpoint stall", figures.stall_s),
    ]
    return [
        f"run {figures.run}: {figures.attempts} attempt(s), {figures.restarts} restart(s), "
        f"{period}",
        f"  {'wall time':<18}{human_seconds(wall):>9}",
        *(f"  {name:<18}{human_seconds(value):>9}  {share(value)}" for name, value in rows),
        f"  {'goodput':<18}{100 * figures.goodput:8.1f}%",
    ]


def cmd_goodput(args: argparse.Namespace) -> int:
    """Print the run's goodput (``--json``: every figure in seconds, and ``goodput``)."""
    with Catalog(resolve_catalog_url(args.catalog)) as catalog:
        figures = from_catalog(catalog, args.run)
    if args.json:
        print_json(figures.to_dict())
        return EXIT_OK
    for line in lines(figures):
        say(line)
    return EXIT_OK
