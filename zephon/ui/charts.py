"""The three charts of a run's page, drawn from its view (``views.run_view``) as inline SVG
(``zephon.ui.svg``): the timeline of saves, duration by phase with the stall, and tiers
with upload lag. The same view is the page's JSON; the charts are only its picture."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from zephon.ui.svg import Plot, Rows

__all__ = ["run_charts"]

EMERGENCY = "#c62828"
ATTEMPT_START = "#6a1b9a"
STALL = "#c62828"
LAG = "#ef6c00"
TIERS = ("memory", "local", "save_dir")


def _seconds(at: str | None) -> float | None:
    return datetime.fromisoformat(at).timestamp() if at else None


def _when(checkpoint: dict[str, Any]) -> float | None:
    return _seconds(checkpoint["committed_at"] or checkpoint["created_at"])


def timeline(view: dict[str, Any]) -> str:
    """Step against time, a line per attempt (marker size by bytes), emergency saves and
    the start of each attempt at the step it resumed from."""
    plot = Plot("time (UTC)", "step", x_time=True)
    rows = [c for c in view["checkpoints"] if _when(c) is not None]
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for c in rows:
        if c["trigger"] != "emergency":
            by_epoch.setdefault(c["epoch"], []).append(c)
    for epoch, saves in sorted(by_epoch.items()):
        plot.line(
            f"attempt {epoch}",
            [_when(c) or 0.0 for c in saves],
            [c["step"] for c in saves],
            texts=[f"step {c['step']}: {c['state']}, {c['bytes'] or 0} bytes" for c in saves],
            sizes=[6 + min(14.0, (c["bytes"] or 0).bit_length() / 2) for c in saves],
        )
    emergency = [c for c in rows if c["trigger"] == "emergency"]
    plot.markers(
        "emergency save",
        [_when(c) or 0.0 for c in emergency],
        [c["step"] for c in emergency],
        color=EMERGENCY,
        symbol="x",
        size=12,
        texts=[f"emergency save at step {c['step']}: {c['state']}" for c in emergency],
    )
    starts = [a for a in view["attempts"] if a["started_at"]]
    plot.markers(
        "attempt start",
        [_seconds(a["started_at"]) or 0.0 for a in starts],
        [a["resumed_from"] or 0 for a in starts],
        color=ATTEMPT_START,
        symbol="triangle",
        size=12,
        texts=[f"attempt {a['epoch']} resumed from {a['resumed_from']}" for a in starts],
    )
    return plot.render(label="timeline of saves: step against time, per attempt")


def phases(view: dict[str, Any]) -> str:
    """Each save's duration stacked by phase, and its stall as a line over them."""
    plot = Plot("step", "seconds")
    rows = [c for c in view["checkpoints"] if c["timings"]]
    steps = [c["step"] for c in rows]
    names = list(view["phases"])
    plot.stacked(names, steps, [[float(c["timings"].get(p) or 0) for c in rows] for p in names])
    plot.line(
        "stall_s",
        steps,
        [float(c["timings"].get("stall_s") or 0) for c in rows],
        color=STALL,
        texts=[f"step {c['step']}: stall {c['timings'].get('stall_s') or 0} s" for c in rows],
    )
    return plot.render(label="duration of each save by phase, and its stall")


def tiers(view: dict[str, Any]) -> str:
    """Upload lag per step (bars, or an area for many), and which tiers hold each step."""
    rows = view["checkpoints"]
    lagged = [c for c in rows if c["upload_lag_s"] is not None]
    steps = [c["step"] for c in rows]
    span = (min(steps), max(steps)) if steps else None
    plot = Plot("step", "upload lag (s)", height=200, x_range=span)
    plot.stacked(
        ["upload lag (s)"],
        [c["step"] for c in lagged],
        [[c["upload_lag_s"] for c in lagged]],
        colors=[LAG],
    )
    held = Rows("step")
    for tier in TIERS:
        steps = [
            c["step"]
            for c in rows
            if any(t["tier"] == tier and t["state"] == "committed" for t in c["tiers"])
        ]
        held.add(tier, steps, [f"step {s} on {tier}" for s in steps])
    return plot.render(label="upload lag per step") + held.render(
        label="tiers holding each step", x_range=span
    )


def run_charts(view: dict[str, Any]) -> dict[str, str]:
    """Chart name -> SVG markup, for the run page's template."""
    return {"timeline": timeline(view), "phases": phases(view), "tiers": tiers(view)}
