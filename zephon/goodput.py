"""Goodput of a run: how much of its wall time trained, computed from what the catalog holds
(docs/goodput.md defines every figure and the estimates it rests on).

``compute`` is pure: it takes plain records (``AttemptSpan``, ``SaveSpan``) and returns a
``Goodput`` whose parts add up to the wall time exactly, none below zero. ``from_catalog``
is the query layer: it reads a run's attempts, checkpoints and resume decisions through the
catalog's public methods and calls ``compute``. Neither imports torch or any storage module,
so ``zephon goodput`` stays as light as the other catalog commands.

The run's time line is cut into disjoint pieces:

- *overhead*: no attempt making progress: from the first attempt's start to its first
  progress, and from each attempt's last record to the next attempt's first progress;
- per attempt, from its first progress to its last record: *stall* (``stall_s`` of its saves),
  *lost* (time after the last checkpoint of it that a later attempt kept, i.e. work redone)
  and *productive* (the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zephon.catalog import Catalog

__all__ = ["AttemptSpan", "Goodput", "SaveSpan", "compute", "from_catalog"]

#: events read to find when each attempt decided its resume point (newest first)
_EVENT_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class AttemptSpan:
    """One attempt as the catalog knows it. ``epoch`` 0 is the pseudo-attempt of a run that
    never registered one (an unfenced run). ``started_at`` is its process start;
    ``progress_at`` its first progress (when it decided where to resume, else when it was
    registered); ``resumed_from`` the step it resumed from (None: a fresh start), if it
    ``decided`` (an attempt that never decided discards nothing of earlier ones)."""

    epoch: int
    started_at: datetime
    progress_at: datetime
    resumed_from: int | None
    decided: bool = True


@dataclass(frozen=True, slots=True)
class SaveSpan:
    """One checkpoint row: its ``step``, the attempt (``epoch``) that armed it, when the save
    began (``created_at``) and committed (``committed_at``: None if it never did), and how long
    it blocked training (``stall_s``: 0 when it was not timed)."""

    step: int
    epoch: int
    created_at: datetime
    committed_at: datetime | None
    stall_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Goodput:
    """A run's time, in seconds: ``wall_s == productive_s + lost_s + overhead_s + stall_s``.

    ``lost_s`` is work redone after restarts, ``overhead_s`` restart overhead (no attempt
    making progress), ``stall_s`` saves blocking training. ``goodput`` is
    ``productive_s / wall_s`` (1.0 for a run of no measurable length)."""

    run: str
    started_at: datetime | None
    ended_at: datetime | None
    attempts: int
    restarts: int
    wall_s: float
    productive_s: float
    lost_s: float
    overhead_s: float
    stall_s: float

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (timestamps as ISO 8601), with ``goodput``."""
        values = asdict(self)
        for key in ("started_at", "ended_at"):
            values[key] = values[key].isoformat() if values[key] is not None else None
        values["goodput"] = self.goodput
        return values


def _seconds(later: datetime, earlier: datetime) -> float:
    return max(0.0, (later - earlier).total_seconds())


def compute(
    run: str,
    attempts: Sequence[AttemptSpan],
    saves: Sequence[SaveSpan],
    *,
    ended_at: datetime | None = None,
) -> Goodput:
    """The goodput of ``run`` from its attempts (any order; epochs unique) and checkpoint
    rows. ``ended_at`` is when the run ended if known (a finished run); otherwise, and never
    before, the run ends at its last record. Pure: the same records give the same figures."""
    ordered = sorted(attempts, key=lambda a: a.epoch)
    if not ordered:
        return Goodput(run, None, ended_at, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    start = min(a.started_at for a in ordered)
    by_epoch: dict[int, list[SaveSpan]] = {a.epoch: [] for a in ordered}
    first = ordered[0].epoch
    for save in saves:
        # a row of an epoch the catalog has no attempt for: the newest attempt not above it
        owner = max((e for e in by_epoch if e <= save.epoch), default=first)
        by_epoch[owner].append(save)
    # Each attempt's last record; the run ends at the latest one (or ended_at, if later).
    last: dict[int, datetime] = {}
    for attempt in ordered:
        times = [attempt.progress_at]
        for save in by_epoch[attempt.epoch]:
            times.append(save.created_at)
            if save.committed_at is not None:
                times.append(save.committed_at)
        last[attempt.epoch] = max(times)
    end = max([*last.values(), start])
    if ended_at is not None and ended_at > end:
        end = ended_at
        last[ordered[-1].epoch] = max(last[ordered[-1].epoch], ended_at)

    productive = lost = stall = 0.0
    cursor = start  # attempts' spans never overlap: a later one begins after an earlier one
    for index, attempt in enumerate(ordered):
        # the attempt's progress ends at its last record or where the next one began
        begin = min(max(attempt.progress_at, cursor), end)
        stop = min(last[attempt.epoch], end)
        if index + 1 < len(ordered):
            stop = min(stop, ordered[index + 1].progress_at)
        stop = cursor = max(stop, begin)
        span = _seconds(stop, begin)
        own = [s for s in by_epoch[attempt.epoch] if begin <= s.created_at <= stop]
        later = [a for a in ordered[index + 1 :] if a.decided]
        if later:
            # work kept: up to the newest of its committed saves that every later attempt
            # resumed from or above (a fresh start keeps nothing)
            floor = min(-1 if a.resumed_from is None else a.resumed_from for a in later)
            kept = [s for s in own if s.committed_at is not None and s.step <= floor]
            keep_until = max((s.created_at for s in kept), default=begin)
        else:
            keep_until = stop
        attempt_stall = min(span, sum(max(0.0, s.stall_s) for s in own))
        after = min(span, sum(max(0.0, s.stall_s) for s in own if s.created_at >= keep_until))
        attempt_lost = min(span - attempt_stall, max(0.0, _seconds(stop, keep_until) - after))
        stall += attempt_stall
        lost += attempt_lost
        productive += span - attempt_stall - attempt_lost
    wall = _seconds(end, start)
    overhead = max(0.0, wall - productive - lost - stall)
    return Goodput(
        run=run,
        started_at=start,
        ended_at=end,
        attempts=len([a for a in ordered if a.epoch > 0]),
        restarts=max(0, len(ordered) - 1),
        wall_s=wall,
        productive_s=productive,
        lost_s=lost,
        overhead_s=overhead,
        stall_s=stall,
    )


def from_catalog(catalog: Catalog, run: str) -> Goodput:
    """``compute`` over what ``catalog`` holds of ``run`` (``RunNotFoundError`` for a run it
    does not know): its attempts, first progress being the attempt's ``resume_decided`` event,
    else its registration; its saves from the audit log (a re-armed row keeps only its newest
    save, the log every one), completed by the checkpoint rows the log no longer holds (pruned,
    or indexed by ``zephon sync``); for a finished run, the row's last update as its end."""
    record = catalog.get_run(run)
    events = sorted(catalog.events(run=run, limit=_EVENT_LIMIT), key=lambda e: (e.at, e.id))
    decided: dict[int, datetime] = {}
    logged: dict[str, dict[str, Any]] = {}
    for event in events:
        detail = event.detail or {}
        if event.action == "resume_decided" and isinstance(detail.get("epoch"), int):
            decided.setdefault(detail["epoch"], event.at)
        save_id = detail.get("save_id")
        if not isinstance(save_id, str) or event.step is None:
            continue
        save = logged.setdefault(save_id, {"step": event.step, "created_at": event.at})
        if isinstance(detail.get("epoch"), int):
            save.setdefault("epoch", detail["epoch"])
        if event.action == "committed":
            save.setdefault("committed_at", event.at)
        timings = detail.get("timings")
        if isinstance(timings, dict) and isinstance(timings.get("stall_s"), int | float):
            save["stall_s"] = float(timings["stall_s"])
    rows = catalog.list_checkpoints(run)
    for row in rows:
        save = logged.get(row.save_id)
        if save is None:
            logged[row.save_id] = {
                "step": row.step,
                "epoch": row.epoch,
                "created_at": row.created_at,
                "committed_at": row.committed_at,
            }
            save = logged[row.save_id]
        if "stall_s" not in save and row.timings and "stall_s" in row.timings:
            save["stall_s"] = float(row.timings["stall_s"])
    saves = [
        SaveSpan(
            step=s["step"],
            epoch=s.get("epoch", 0),
            created_at=s["created_at"],
            committed_at=s.get("committed_at"),
            stall_s=s.get("stall_s", 0.0),
        )
        for s in logged.values()
    ]
    spans = [
        AttemptSpan(
            epoch=a.epoch,
            started_at=min(a.started_at, a.registered_at),
            progress_at=decided.get(a.epoch, a.registered_at),
            resumed_from=a.resumed_from,
            decided=a.decided,
        )
        for a in catalog.list_attempts(run)
    ]
    if not spans:
        # an unfenced run: one attempt, from the run's creation
        first = min([record.created_at, *(s.created_at for s in saves)])
        spans = [AttemptSpan(0, first, first, None)]
    ended = record.updated_at if record.status == "finished" else None
    return compute(run, spans, saves, ended_at=ended)
