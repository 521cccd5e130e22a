"""Retention planning: which checkpoints of one run to keep, delete, or expire, and why.

``plan_retention`` is a pure function of the rows, the policy and the clock; it reads and writes
nothing, so ``zephon gc --dry-run`` and the tests use it as is. Acting on a plan is the
caller's job: ``Catalog.claim_for_deletion`` re-plans inside its transaction, with the same
function and the same inputs, before claiming, because rows may have changed since the plan
was made.

Rules:

- ``committed`` rows: kept are the newest one (always, whatever the policy), the
  ``num_to_keep`` newest ones (``None`` keeps all), milestones (``step % keep_every_steps ==
  0``) and pinned ones; every other committed row is deleted. "Newest" means highest step.
  Only committed rows count towards ``num_to_keep``.
- The *resume point* (the step the current attempt resumed from) is always kept, whatever its
  state: retention never deletes the step the current attempt resumed from.
- ``stale`` rows (an abandoned lineage) are deleted once they have been stale for ``grace``
  (since ``updated_at``), kept before that.
- ``corrupt`` rows are kept for inspection, and deleted only when ``corrupt=True``.
- Pinned rows are kept in every state above.
- ``pending`` rows younger than ``pending_grace`` are kept untouched. Older ones are *expired*:
  the writer most likely crashed. The caller must probe the commit marker first (a crash
  between the marker and the catalog update leaves a complete checkpoint behind a pending
  row): marker present -> commit it; absent -> ``mark_failed`` with the planned save id, after
  which the directory is an uncommitted orphan that gc removes. ``pending_grace`` is separate
  from ``grace`` on purpose: a gc told ``grace=0`` to clear abandoned rows at once must not
  expire a checkpoint that is still being written.
- Rows in any other state (``deleting``, ``deleted``, ``failed``) are not part of a plan;
  ``deleting`` rows (claimed by a gc) are listed in ``RetentionPlan.held``, so gc learns from
  the plan's read whether any claim needs judging.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from zephon.catalog import validate
from zephon.catalog.models import CheckpointState

if TYPE_CHECKING:
    from zephon.catalog.records import AttemptRecord


class Action(StrEnum):
    KEEP = "keep"
    DELETE = "delete"
    EXPIRE = "expire"


DEFAULT_GRACE = timedelta(hours=24)


class RetentionCandidate(Protocol):
    """What planning reads from a row; ``CheckpointRecord`` satisfies it."""

    @property
    def step(self) -> int: ...

    @property
    def state(self) -> str: ...

    @property
    def pinned(self) -> bool: ...

    @property
    def created_at(self) -> datetime: ...

    @property
    def updated_at(self) -> datetime: ...

    @property
    def save_id(self) -> str: ...


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """The step the current attempt (``epoch``) resumed from; retention always keeps it."""

    step: int
    epoch: int

    @property
    def reason(self) -> str:
        return f"resume point of the current attempt (epoch {self.epoch})"


@dataclass(frozen=True, slots=True)
class Decision:
    """The fate of one planned row (committed, pending, stale or corrupt), with every reason
    that applies."""

    step: int
    state: str
    action: Action
    reasons: tuple[str, ...]
    save_id: str

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """Decisions for the planned rows of one run, in ascending step order; the steps being
    deleted (``deleting``: claimed by a gc) and the run's current attempt (None: unfenced)
    when it was made, both read in the plan's transaction (``Catalog.retention_plan``), so a
    saving job's retention checks its fence and judges held claims without another read."""

    decisions: tuple[Decision, ...]
    held: tuple[int, ...] = ()
    current: AttemptRecord | None = None

    @property
    def to_delete(self) -> list[int]:
        """Steps to claim for deletion (committed, stale, and corrupt ones if asked)."""
        return [d.step for d in self.decisions if d.action is Action.DELETE]

    @property
    def to_expire(self) -> list[Decision]:
        """Pending rows older than the grace period (probe the marker, then commit or fail)."""
        return [d for d in self.decisions if d.action is Action.EXPIRE]

    @property
    def kept(self) -> list[Decision]:
        return [d for d in self.decisions if d.action is Action.KEEP]


def validate_policy(num_to_keep: int | None, keep_every_steps: int | None) -> None:
    """Raise ``InvalidValueError`` unless both values are ``None`` or integers from 1 to what
    their columns hold (``num_to_keep`` an INTEGER, ``keep_every_steps`` a BIGINT)."""
    validate.num_to_keep(num_to_keep)
    validate.keep_every_steps(keep_every_steps)


def _keep_reasons(
    step: int, rank: int, pinned: bool, num_to_keep: int | None, keep_every_steps: int | None
) -> list[str]:
    reasons = []
    if rank == 0:
        reasons.append("newest committed")
    if num_to_keep is None:
        reasons.append("num_to_keep is null (keep all)")
    elif rank < num_to_keep:
        reasons.append(f"one of the {num_to_keep} newest committed")
    if keep_every_steps is not None and step % keep_every_steps == 0:
        reasons.append(f"milestone (every {keep_every_steps} steps)")
    if pinned:
        reasons.append("pinned")
    return reasons


def plan_retention(
    checkpoints: Iterable[RetentionCandidate],
    num_to_keep: int | None,
    keep_every_steps: int | None,
    now: datetime,
    grace: timedelta,
    *,
    pending_grace: timedelta = DEFAULT_GRACE,
    corrupt: bool = False,
    resume_point: ResumePoint | None = None,
) -> RetentionPlan:
    """Plan retention for the rows of one run; see the module docstring for the rules.

    ``grace`` is how long ``stale`` rows stay, ``pending_grace`` how long ``pending`` ones may
    take to commit; ``corrupt`` deletes ``corrupt`` rows; ``resume_point`` is kept whatever.
    """
    validate_policy(num_to_keep, keep_every_steps)
    validate.duration("grace", grace)
    validate.duration("pending_grace", pending_grace)
    validate.aware("now", now)

    rows = list(checkpoints)

    def protections(row: RetentionCandidate) -> list[str]:
        reasons = [resume_point.reason] if resume_point and row.step == resume_point.step else []
        return reasons + (["pinned"] if row.pinned else [])

    committed = sorted(
        (c for c in rows if c.state == CheckpointState.COMMITTED), key=lambda c: -c.step
    )
    decisions = []
    for rank, row in enumerate(committed):
        reasons = _keep_reasons(row.step, rank, row.pinned, num_to_keep, keep_every_steps)
        if resume_point is not None and row.step == resume_point.step:
            reasons.append(resume_point.reason)
        if not reasons:
            action, reasons = Action.DELETE, [f"older than the {num_to_keep} newest committed"]
        else:
            action = Action.KEEP
        decisions.append(Decision(row.step, row.state, action, tuple(reasons), row.save_id))
    for row in rows:
        if row.state == CheckpointState.PENDING:
            action, reasons = _pending(now - row.created_at, pending_grace)
        elif row.state == CheckpointState.STALE:
            action, reasons = _stale(now - row.updated_at, grace, protections(row))
        elif row.state == CheckpointState.CORRUPT:
            action, reasons = _corrupt(corrupt, protections(row))
        else:
            continue
        decisions.append(Decision(row.step, row.state, action, tuple(reasons), row.save_id))
    decisions.sort(key=lambda d: d.step)
    held = sorted(row.step for row in rows if row.state == CheckpointState.DELETING)
    return RetentionPlan(tuple(decisions), tuple(held))


def _pending(age: timedelta, pending_grace: timedelta) -> tuple[Action, list[str]]:
    if age < pending_grace:
        return Action.KEEP, [f"pending for {_human(age)}, within grace {_human(pending_grace)}"]
    return Action.EXPIRE, [
        f"pending for {_human(age)}, beyond grace {_human(pending_grace)}: probe its commit "
        f"marker, then commit or fail it"
    ]


def _stale(age: timedelta, grace: timedelta, kept: list[str]) -> tuple[Action, list[str]]:
    if kept:
        return Action.KEEP, [f"abandoned lineage, stale for {_human(age)}", *kept]
    if age < grace:
        return Action.KEEP, [
            f"abandoned lineage, stale for {_human(age)}, within grace {_human(grace)}"
        ]
    return Action.DELETE, [
        f"abandoned lineage, stale for {_human(age)}, beyond grace {_human(grace)}"
    ]


def _corrupt(delete: bool, kept: list[str]) -> tuple[Action, list[str]]:
    if kept:
        return Action.KEEP, ["corrupt", *kept]
    if delete:
        return Action.DELETE, ["corrupt, and corrupt checkpoints are to be deleted"]
    return Action.KEEP, ["corrupt: kept for inspection until deleted with corrupt=True"]


def _human(delta: timedelta) -> str:
    seconds = max(int(delta.total_seconds()), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h" if rest == 0 else f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m" if secs == 0 else f"{minutes}m{secs:02d}s"
    return f"{secs}s"
