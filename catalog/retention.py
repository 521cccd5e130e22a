"""Retention planning: which checkpoints of one run to keep, delete, or expire, and why.

``plan_retention`` is a pure function of the rows, the policy and the clock; it reads and writes
nothing, so ``zephon gc --dry-run`` and the tests use it as is. Acting on a plan is the
caller's job: ``Catalog.claim_for_deletion`` re-plans inside its transaction before claiming,
because rows may have changed since the plan was made.

Rules (DESIGN.md "Retention"):

- Only ``committed`` rows are ever planned for deletion. Kept are: the newest committed one
  (always, whatever the policy), the ``num_to_keep`` newest committed ones (``None`` keeps all),
  milestones (``step % keep_every_steps == 0``) and pinned ones. Every other committed row is
  deleted. "Newest" means highest step.
- ``pending`` rows younger than ``grace`` are kept untouched. Older ones are *expired*: the
  writer most likely crashed. The caller must probe the commit marker first (a crash between
  the marker and the catalog update leaves a complete checkpoint behind a pending row): marker
  present -> ``mark_committed``; absent -> ``mark_failed`` with the planned save id, after
  which the directory is an uncommitted orphan that gc removes.
- Rows in any other state (``deleting``, ``deleted``, ``failed``) are not part of a plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from catalog.errors import InvalidValueError
from catalog.models import CheckpointState


class Action(StrEnum):
    KEEP = "keep"
    DELETE = "delete"
    EXPIRE = "expire"


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
    def save_id(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Decision:
    """The fate of one committed or pending row, with every reason that applies."""

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
    """Decisions for the committed and pending rows of one run, in ascending step order."""

    decisions: tuple[Decision, ...]

    @property
    def to_delete(self) -> list[int]:
        """Steps of committed rows to claim for deletion."""
        return [d.step for d in self.decisions if d.action is Action.DELETE]

    @property
    def to_expire(self) -> list[Decision]:
        """Pending rows older than the grace period (probe the marker, then commit or fail)."""
        return [d for d in self.decisions if d.action is Action.EXPIRE]

    @property
    def kept(self) -> list[Decision]:
        return [d for d in self.decisions if d.action is Action.KEEP]


def validate_policy(num_to_keep: int | None, keep_every_steps: int | None) -> None:
    """Raise ``InvalidValueError`` unless both values are ``None`` or integers >= 1."""
    for name, value in (("num_to_keep", num_to_keep), ("keep_every_steps", keep_every_steps)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise InvalidValueError(name, value, "expected an integer >= 1, or null")


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
) -> RetentionPlan:
    """Plan retention for the rows of one run; see the module docstring for the rules."""
    validate_policy(num_to_keep, keep_every_steps)
    if grace < timedelta(0):
        raise InvalidValueError("grace", grace, "expected a duration >= 0")
    if now.tzinfo is None:
        raise InvalidValueError("now", now, "expected a timezone-aware datetime")

    rows = list(checkpoints)
    committed = sorted(
        (c for c in rows if c.state == CheckpointState.COMMITTED), key=lambda c: -c.step
    )
    decisions = []
    for rank, row in enumerate(committed):
        reasons = _keep_reasons(row.step, rank, row.pinned, num_to_keep, keep_every_steps)
        if not reasons:
            action, reasons = Action.DELETE, [f"older than the {num_to_keep} newest committed"]
        else:
            action = Action.KEEP
        decisions.append(Decision(row.step, row.state, action, tuple(reasons), row.save_id))
    for row in rows:
        if row.state != CheckpointState.PENDING:
            continue
        age = now - row.created_at
        if age < grace:
            action = Action.KEEP
            why = f"pending for {_human(age)}, within grace {_human(grace)}"
        else:
            action = Action.EXPIRE
            why = (
                f"pending for {_human(age)}, beyond grace {_human(grace)}: probe its commit "
                f"marker, then commit or fail it"
            )
        decisions.append(Decision(row.step, row.state, action, (why,), row.save_id))
    decisions.sort(key=lambda d: d.step)
    return RetentionPlan(tuple(decisions))


def _human(delta: timedelta) -> str:
    seconds = max(int(delta.total_seconds()), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h" if rest == 0 else f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m" if secs == 0 else f"{minutes}m{secs:02d}s"
    return f"{secs}s"
