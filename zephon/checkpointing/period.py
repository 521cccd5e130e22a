"""``period_steps: auto``: the save interval from the measured cost of a save and the run's
failure history (docs/goodput.md, "Choosing the save period").

Young's rule: saving every ``sqrt(2 * stall * MTBF)`` seconds of training minimises the
expected time lost to saves plus the work redone after a failure; Daly's higher-order form
(used here) corrects it when the stall is not small against the MTBF. The interval becomes
a number of steps through the measured step time and is bounded by ``min_steps`` and
``max_steps``.

The policy is pure (no clock, no collective, no catalog): ``PeriodPolicy`` is told the time
of each ``should_save`` call and the stall of each save, and decides when asked.
``AutoPeriodDriver`` ties it to a job: every rank measures, rank 0 decides after each save
and one broadcast of the new period follows the save, so all ranks save at the same steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from zephon.errors import ConfigError, invalid_option
from zephon.storage import MAX_STEP

__all__ = [
    "AUTO",
    "AutoPeriod",
    "AutoPeriodDriver",
    "PeriodPolicy",
    "daly_interval_s",
    "mtbf_from_starts",
    "steps_for",
]

#: the ``period_steps`` value that turns the policy on
AUTO = "auto"
#: the weight of a new step-time measurement in the running average
_STEP_WEIGHT = 0.3
#: the largest prior MTBF: ten years
MAX_MTBF_S = 10 * 365 * 86400.0


@dataclass(frozen=True, slots=True)
class AutoPeriod:
    """``auto_period``: the bounds of the chosen period, in steps, and ``mtbf_s``, the mean
    time between failures assumed while the run has no failure history (its prior)."""

    min_steps: int = 10
    max_steps: int = 10_000
    mtbf_s: float = 86400.0

    @classmethod
    def checked(cls, value: Any, key: str) -> AutoPeriod:
        """An ``AutoPeriod`` from itself, None (the defaults) or a mapping of its fields;
        ``ConfigError`` naming ``key`` and the fix for anything else."""
        if value is None:
            return cls()
        if isinstance(value, AutoPeriod):
            value = {"min_steps": value.min_steps, "max_steps": value.max_steps,
                     "mtbf_s": value.mtbf_s}  # fmt: skip
        if not isinstance(value, Mapping):
            raise invalid_option(key, value, "use a mapping of min_steps, max_steps, mtbf_s")
        unknown = sorted(set(value) - {"min_steps", "max_steps", "mtbf_s"})
        if unknown:
            raise ConfigError(
                f"{key}.{unknown[0]} is not a known setting; known: max_steps, min_steps, mtbf_s"
            )
        values = {**{"min_steps": 10, "max_steps": 10_000, "mtbf_s": 86400.0}, **value}
        for name in ("min_steps", "max_steps"):
            steps = values[name]
            if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEP:
                raise invalid_option(f"{key}.{name}", steps, f"use an integer from 1 to {MAX_STEP}")
        if values["min_steps"] > values["max_steps"]:
            raise invalid_option(
                f"{key}.min_steps",
                values["min_steps"],
                f"use at most {key}.max_steps ({values['max_steps']})",
            )
        mtbf = values["mtbf_s"]
        if (
            isinstance(mtbf, bool)
            or not isinstance(mtbf, int | float)
            or not 1 <= mtbf <= MAX_MTBF_S
        ):
            raise invalid_option(
                f"{key}.mtbf_s", mtbf, f"use a number of seconds from 1 to {MAX_MTBF_S:g}"
            )
        return cls(values["min_steps"], values["max_steps"], float(mtbf))


def daly_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Seconds of training between saves: Daly's higher-order optimum for a save costing
    ``stall_s`` and failures ``mtbf_s`` apart (``sqrt(2 * stall * MTBF)``, Young's, when the
    stall is small); the MTBF itself once a save costs half of it or more."""
    if stall_s <= 0:
        return 0.0
    if stall_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = stall_s / (2 * mtbf_s)
    young = math.sqrt(2 * stall_s * mtbf_s)
    return max(0.0, young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - stall_s)


def steps_for(interval_s: float, step_s: float, bounds: AutoPeriod) -> int:
    """``interval_s`` as a whole number of steps of ``step_s`` seconds, within the bounds."""
    if step_s <= 0 or not math.isfinite(interval_s / step_s):
        return bounds.max_steps if interval_s > 0 else bounds.min_steps
    return max(bounds.min_steps, min(bounds.max_steps, round(interval_s / step_s)))


def mtbf_from_starts(starts: Sequence[datetime], now: datetime, prior_s: float) -> float:
    """The run's mean time between failures: its lifetime (from its first attempt's start to
    ``now``) plus ``prior_s`` (the prior, counted as one failure-free interval already seen),
    over its restarts plus one. With no restart it is the prior plus the time the run has
    survived; each restart pulls it towards the observed mean."""
    if not starts:
        return prior_s
    lifetime = max(0.0, (now - min(starts)).total_seconds())
    return (lifetime + prior_s) / len(starts)


class PeriodPolicy:
    """The save period of one job under ``period_steps: auto``.

    ``tick(step, now)`` on every ``should_save`` (``now``: a monotonic clock) measures the
    step time; ``saved(step, stall_s)`` after every save; ``decide(mtbf_s)`` returns the new
    period in steps (rank 0 calls it, and every rank then ``adopt``s the answer).
    ``due(step, total_steps)`` says whether a save is due: ``period`` steps after the last
    save (the resume step counts as one), and at the last step. The first period is
    ``min_steps``: the first save measures what the next periods are made of."""

    def __init__(self, bounds: AutoPeriod) -> None:
        self.bounds = bounds
        self.period = bounds.min_steps
        self.last_saved = 0
        self.step_s: float | None = None
        self.stall_s: float | None = None
        self._tick: tuple[int, float] | None = None
        self._stalled = 0.0

    def tick(self, step: int, now: float) -> None:
        """A ``should_save(step)`` call at ``now``: the time since the previous one, less the
        saves in between, over the steps in between, is the newest step time."""
        if self._tick is not None:
            previous, then = self._tick
            if step > previous:
                measured = max(0.0, now - then - self._stalled) / (step - previous)
                self.step_s = (
                    measured
                    if self.step_s is None
                    else (1 - _STEP_WEIGHT) * self.step_s + _STEP_WEIGHT * measured
                )
        self._tick, self._stalled = (step, now), 0.0

    def resumed(self, step: int | None) -> None:
        """The job resumed from ``step`` (None: a fresh start): the next save is a period on."""
        self.last_saved = step or 0

    def saved(self, step: int, stall_s: float) -> None:
        """A save of ``step`` blocked training ``stall_s`` seconds."""
        self.last_saved = step
        self._stalled += max(0.0, stall_s)
        self.stall_s = max(0.0, stall_s)

    def due(self, step: int, total_steps: int | None) -> bool:
        if total_steps is not None and step == total_steps:
            return True
        return step - self.last_saved >= self.period

    def decide(self, mtbf_s: float) -> int:
        """The period the measurements so far call for (the current one until a save and a
        step time were measured)."""
        if self.stall_s is None or self.step_s is None:
            return self.period
        return steps_for(daly_interval_s(self.stall_s, mtbf_s), self.step_s, self.bounds)

    def adopt(self, period: int) -> str | None:
        """Take ``period`` (rank 0's decision); returns the line to log if it changed."""
        if period == self.period:
            return None
        old, self.period = self.period, period
        return f"save period {old} -> {period} steps"

    def describe(self, mtbf_s: float) -> str:
        """``(stall 0.8 s, step 0.5 s, MTBF 6.0 h)``: what the decision was made of."""
        return (
            f"(stall {self.stall_s or 0.0:.2g} s, step {self.step_s or 0.0:.2g} s, "
            f"MTBF {mtbf_s / 3600:.1f} h)"
        )


class AutoPeriodDriver:
    """``PeriodPolicy`` in a job: every rank measures, rank 0 decides, every rank adopts.

    ``coll`` is the job's ``zephon.collectives.Collectives``; ``mtbf`` (rank 0) returns the
    run's MTBF in seconds, called once at the first decision; ``log`` takes the line of
    each change; ``clock`` is a monotonic clock."""

    def __init__(
        self,
        bounds: AutoPeriod,
        coll: Any,
        mtbf: Callable[[], float],
        log: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = PeriodPolicy(bounds)
        self.coll = coll
        self._mtbf = mtbf
        self._mtbf_s: float | None = None
        self._log = log
        self._clock = clock

    @property
    def period(self) -> int:
        return self.policy.period

    def should_save(self, step: int, total_steps: int | None) -> bool:
        self.policy.tick(step, self._clock())
        return self.policy.due(step, total_steps)

    def resumed(self, step: int | None) -> None:
        self.policy.resumed(step)

    def saved(self, step: int, stall_s: float) -> int:
        """Collective, after every save: rank 0 decides the period, every rank takes it (one
        broadcast of an integer). Returns the period."""
        self.policy.saved(step, stall_s)
        decision: int | None = None
        if self.coll.is_main:
            if self._mtbf_s is None:
                self._mtbf_s = self._mtbf()
            decision = self.policy.decide(self._mtbf_s)
        decision = self.coll.broadcast(decision)
        changed = self.policy.adopt(int(decision))
        if changed is not None and self.coll.is_main:
            self._log(f"zephon: {changed} {self.policy.describe(self._mtbf_s or 0.0)}")
        return self.policy.period
