"""What each page of ``zephon ui`` shows, as plain JSON-ready dicts read from a read-only
``Catalog``: the HTML pages render them, the ``/api/...`` endpoints return them as they are.

Costs are bounded by what a page shows: the runs page reads one page of runs (default 50)
and their save rows in two batch queries (``Catalog.run_page``, ``save_rows``,
``attempts_of``); a run's page reads that run only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from zephon.catalog import TIMING_PHASES, AttemptSaves, Catalog, CopyRow, TimelineRow
from zephon.goodput import AttemptSpan, SaveSpan, compute
from zephon.ui.figures import GoodputCache

__all__ = ["PAGE_SIZE", "RunFilter", "attempt_save_spans", "goodput_of", "run_view", "runs_view"]

PAGE_SIZE = 50
#: phases drawn as the stacked bars of a save's duration (total_s is their sum, stall_s is
#: drawn as its own line: it overlaps the others)
PHASES = tuple(p for p in TIMING_PHASES if p not in ("total_s", "stall_s"))
#: states a retention view groups rows by
RETENTION = ("committed", "pinned", "deleting", "deleted", "stale")
DAMAGED = ("corrupt", "failed")


def _iso(at: datetime | None) -> str | None:
    return at.isoformat(timespec="milliseconds") if at is not None else None


#: steps of the synthetic saves below: never at or below a resume point / always at or below
_NEVER_KEPT = 1 << 62
_ALWAYS_KEPT = -(1 << 62)


def attempt_save_spans(summaries: list[AttemptSaves]) -> list[SaveSpan]:
    """``SaveSpan``s that give ``goodput.compute`` what it derives from a run's rows, built
    from per-attempt aggregates (``Catalog.save_summaries``) instead of every row: per
    attempt, its last record (the last save's start and the last commit), its stall before
    the kept save and from it on, and the kept save (``kept_until``). ``compute`` over them
    gives its figures over the rows themselves (tests/zephon/ui/test_views.py checks)."""
    spans = []
    for summary in summaries:
        epoch = summary.epoch
        last = SaveSpan(_NEVER_KEPT, epoch, summary.last_created_at, summary.last_committed_at, 0.0)
        spans.append(last)
        if summary.kept_until is None:
            spans.append(
                SaveSpan(_NEVER_KEPT, epoch, summary.first_created_at, None, summary.stall_s)
            )
            continue
        before = max(0.0, summary.stall_s - summary.stall_after_kept_s)
        spans += [
            SaveSpan(_NEVER_KEPT, epoch, summary.first_created_at, None, before),
            SaveSpan(_NEVER_KEPT, epoch, summary.kept_until, None, summary.stall_after_kept_s),
            SaveSpan(_ALWAYS_KEPT, epoch, summary.kept_until, summary.kept_until, 0.0),
        ]
    return spans


def goodput_of(record, attempts, summaries: list[AttemptSaves]) -> dict[str, Any]:
    """A run's goodput (``zephon.goodput.compute``) from its record, attempts and per-attempt
    save aggregates. Each attempt's first progress is taken at its registration: the exact
    moment it decided where to resume is in the audit log, which ``zephon goodput`` reads
    (unbounded per run, so a dashboard does not)."""
    return goodput_over(record, attempts, attempt_save_spans(summaries))


def _stall(timings: dict[str, float]) -> float:
    value = timings.get("stall_s", 0.0)
    return float(value) if isinstance(value, int | float) else 0.0


def goodput_over(record, attempts, saves: list[SaveSpan]) -> dict[str, Any]:
    """``goodput_of`` over the run's saves themselves (``SaveSpan``s)."""
    spans = [
        AttemptSpan(
            a.epoch,
            min(a.started_at, a.registered_at),
            a.registered_at,
            a.resumed_from,
            a.decided,
        )
        for a in attempts
    ]
    if not spans:
        first = min([record.created_at, *(s.created_at for s in saves)])
        spans = [AttemptSpan(0, first, first, None)]
    ended = record.updated_at if record.status == "finished" else None
    return compute(record.name, spans, saves, ended_at=ended).to_dict()


def runs_view(
    catalog: Catalog,
    *,
    page: int = 1,
    status: str | None = None,
    figures: GoodputCache | None = None,
) -> dict[str, Any]:
    """The runs page: one page of runs by name with state, latest checkpoint and goodput
    (``goodput_of``, kept between requests by ``figures`` if given)."""
    offset = (page - 1) * PAGE_SIZE
    found = catalog.run_page(offset=offset, limit=PAGE_SIZE, status=status)
    goodput = (figures or GoodputCache(catalog)).figures(found.runs)
    rows = []
    for summary in found.runs:
        run = summary.run
        rows.append(
            {
                "name": run.name,
                "status": run.status,
                "kind": run.kind,
                "epoch": run.epoch,
                "total_steps": run.total_steps,
                "latest_step": summary.latest_step,
                "committed": summary.committed_count,
                "committed_bytes": summary.committed_bytes,
                "pending": summary.pending_count,
                "latest_stall_s": (summary.latest_timings or {}).get("stall_s"),
                "last_activity": _iso(summary.last_activity),
                "goodput": goodput[run.name],
            }
        )
    pages = max(1, -(-found.total // PAGE_SIZE))
    return {
        "page": page,
        "pages": pages,
        "page_size": PAGE_SIZE,
        "total": found.total,
        "status": status,
        "runs": rows,
    }


#: the checkpoint table of a run's page lists this many of the newest rows of its range;
#: the charts and the JSON have them all
TABLE_ROWS = 200


@dataclass(frozen=True, slots=True)
class RunFilter:
    """A run page's filters, all in its URL: a time range of save starts (``since`` and
    ``until``, aware datetimes) and checkpoint ``states`` (empty: every state)."""

    since: datetime | None = None
    until: datetime | None = None
    states: tuple[str, ...] = ()


def _replica_lag(copies: list[CopyRow]) -> dict[str, Any]:
    """Tiers of one step and its upload lag: from the fast tier's commit (local or memory)
    to the save_dir copy's commit; None while the upload is not done."""
    fast = [c.committed_at for c in copies if c.tier != "save_dir" and c.committed_at]
    shared = [c.committed_at for c in copies if c.tier == "save_dir" and c.committed_at]
    lag = max(0.0, (max(shared) - min(fast)).total_seconds()) if fast and shared else None
    return {
        "tiers": [
            {"tier": c.tier, "host": c.host, "state": c.state, "committed_at": _iso(c.committed_at)}
            for c in copies
        ],
        "upload_lag_s": lag,
    }


def _checkpoint(row: TimelineRow, copies: list[CopyRow]) -> dict[str, Any]:
    return {
        "step": row.step,
        "state": row.state,
        "epoch": row.epoch,
        "pinned": row.pinned,
        "bytes": row.bytes,
        "trigger": row.trigger or "periodic",
        "created_at": _iso(row.created_at),
        "committed_at": _iso(row.committed_at),
        "timings": row.timings,
        "failure_reason": row.failure_reason,
        **_replica_lag(copies),
    }


def _attempts(records, checkpoints: list[dict[str, Any]], emergencies: set[int]):
    """Each attempt with what became of it: ``restarted`` when a later attempt followed,
    ``preempted`` when it made an emergency save, and the work a restart lost: the steps it
    reached above where the next attempt resumed."""
    out = []
    for index, attempt in enumerate(records):
        own = [c for c in checkpoints if c["epoch"] == attempt.epoch]
        reached = max((c["step"] for c in own), default=attempt.resumed_from)
        following = records[index + 1] if index + 1 < len(records) else None
        lost_steps = 0
        if following is not None and following.decided and reached is not None:
            floor = following.resumed_from if following.resumed_from is not None else 0
            lost_steps = max(0, reached - floor)
        out.append(
            {
                "epoch": attempt.epoch,
                "host": attempt.host,
                "pid": attempt.pid,
                "started_at": _iso(attempt.started_at),
                "resumed_from": attempt.resumed_from,
                "decided": attempt.decided,
                "reached_step": reached,
                "saves": len(own),
                "restarted": following is not None,
                "preempted": attempt.epoch in emergencies,
                "lost_steps": lost_steps,
            }
        )
    return out


def run_view(catalog: Catalog, name: str, where: RunFilter | None = None) -> dict[str, Any]:
    """A run's page: its record, goodput (as on the runs page), the timeline of its saves in
    ``where``'s range, tiers and upload lag, attempts, retention and damage. Attempts,
    retention and damage are of the whole run; the timeline and the table of the range."""
    where = where or RunFilter()
    record = catalog.get_run(name)
    every, copies = catalog.timeline(name)
    by_step: dict[int, list[CopyRow]] = {}
    for copy in copies:
        by_step.setdefault(copy.step, []).append(copy)
    checkpoints = [_checkpoint(row, by_step.get(row.step, [])) for row in every]
    shown = [
        c
        for c, row in zip(checkpoints, every, strict=True)
        if (where.since is None or row.created_at >= where.since)
        and (where.until is None or row.created_at <= where.until)
        and (not where.states or row.state in where.states)
    ]
    attempts = catalog.list_attempts(name)
    # every row is at hand: goodput over them as they are (the runs page aggregates)
    saves = [
        SaveSpan(r.step, r.epoch, r.created_at, r.committed_at, max(0.0, _stall(r.timings)))
        for r in every
    ]
    figures = goodput_over(record, attempts, saves)
    emergencies = {c["epoch"] for c in checkpoints if c["trigger"] == "emergency"}
    states = Counter(c["state"] for c in checkpoints)
    retention = {state: states.get(state, 0) for state in RETENTION if state != "pinned"}
    retention["pinned"] = sum(1 for c in checkpoints if c["pinned"])
    return {
        "run": {**record.to_dict(), "config": None},
        "goodput": figures,
        "filter": {
            "since": _iso(where.since),
            "until": _iso(where.until),
            "states": list(where.states),
        },
        "checkpoints": shown,
        "table_rows": TABLE_ROWS,
        "phases": [p for p in PHASES if any(p in c["timings"] for c in shown)],
        "attempts": _attempts(attempts, checkpoints, emergencies),
        "retention": retention,
        "damaged": [c for c in checkpoints if c["state"] in DAMAGED],
        "emergency_steps": [c["step"] for c in checkpoints if c["trigger"] == "emergency"],
    }
