"""The manager's save period and metrics (docs/goodput.md): ``period_steps: auto``'s driver on
every rank and rank 0's metrics, fed from the manager's save and load. Kept out of
``manager`` so the manager only calls four hooks."""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from zephon.checkpointing.period import AutoPeriodDriver, mtbf_from_starts

if TYPE_CHECKING:
    from zephon.checkpointing.job import Job
    from zephon.checkpointing.saver import Saver
    from zephon.metrics import Metrics

__all__ = ["Instruments"]

log = logging.getLogger("zephon")

#: the goodput gauge is recomputed from the catalog at most this often (seconds)
GOODPUT_REFRESH_S = 60.0


class Instruments:
    """One job's ``pacing`` (None for a fixed period) and ``metrics`` (rank 0, None unless
    configured). The saver reports each commit to the metrics (from the background thread
    for an async save)."""

    def __init__(self, job: Job, saver: Saver) -> None:
        self.job = job
        config = job.config
        self.pacing: AutoPeriodDriver | None = None
        self.metrics: Metrics | None = None
        self._goodput: tuple[float, float | None] | None = None
        if config.period_steps == "auto":
            self.pacing = AutoPeriodDriver(config.auto_period, job.coll, self.mtbf_s, log.info)
        if config.metrics is not None and job.coll.is_main:
            from zephon.metrics import Metrics

            self.metrics = Metrics(
                config.metrics,
                job.name,
                backlog=lambda: job.destination.backlog(),
                goodput=self.goodput,
            )
            saver.on_committed = self.metrics.committed
            if self.pacing is not None:
                self.metrics.period(self.pacing.period)

    def should_save(self, step: int, total_steps: int | None) -> bool | None:
        """The auto period's answer; None under a fixed period (the config answers)."""
        return None if self.pacing is None else self.pacing.should_save(step, total_steps)

    def saved(self, step: int, stall_s: float) -> None:
        """Every rank, after ``save`` returned (collective under the auto period)."""
        if self.pacing is not None:
            period = self.pacing.saved(step, stall_s)
            if self.metrics is not None:
                self.metrics.period(period)
        if self.metrics is not None:
            self._goodput = None  # the run has a new record: the next read recomputes
            self.metrics.stalled(stall_s)

    def loaded(self, step: int | None, seconds: float) -> None:
        """Every rank, after ``load_latest`` found ``step`` (None: a fresh start)."""
        if self.pacing is not None:
            self.pacing.resumed(step)
        if self.metrics is not None:
            size = None
            catalog = self.job.catalog
            if step is not None and catalog is not None:
                with contextlib.suppress(Exception):
                    size = catalog.get_checkpoint(self.job.name, step).bytes
            self.metrics.loaded(seconds, size)

    def mtbf_s(self) -> float:
        """Rank 0: the run's MTBF from its attempts in the catalog, else the prior."""
        prior = self.job.config.auto_period.mtbf_s
        catalog = self.job.catalog
        if catalog is None:
            return prior
        try:
            starts = [a.started_at for a in catalog.list_attempts(self.job.name)]
        except Exception as exc:  # an outage: the prior, not a failed save
            log.warning("zephon: the run's attempts could not be read (%s): MTBF prior", exc)
            return prior
        return mtbf_from_starts(starts, datetime.now(UTC), prior)

    def goodput(self) -> float | None:
        """Rank 0: the run's goodput ratio from the catalog (None without one, or while it
        cannot answer), recomputed after each save and at most every ``GOODPUT_REFRESH_S``."""
        now = time.monotonic()
        if self._goodput is not None and now - self._goodput[0] < GOODPUT_REFRESH_S:
            return self._goodput[1]
        ratio: float | None = None
        catalog: Any = self.job.catalog
        if catalog is not None:
            from zephon.goodput import from_catalog

            with contextlib.suppress(Exception):
                ratio = from_catalog(catalog, self.job.name).goodput
        self._goodput = (now, ratio)
        return ratio

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
