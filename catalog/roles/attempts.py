"""``Catalog``'s attempt methods: fencing a job's starts (``catalog.attempts`` holds the
protocol)."""

from __future__ import annotations

from datetime import datetime

from zephon.catalog import attempts, validate
from zephon.catalog.records import AttemptRecord, AttemptRegistration
from zephon.catalog.runs import UNSET, _Unset
from zephon.catalog.session_base import CatalogBase, utc_now

__all__ = ["AttemptMethods"]


class AttemptMethods(CatalogBase):
    """The attempts role of ``Catalog``: register, decide, read the current one, list."""

    def register_attempt(
        self,
        run: str,
        *,
        epoch: int,
        attempt_id: str,
        host: str,
        pid: int,
        started_at: datetime,
        resumed_from: int | None | _Unset = UNSET,
    ) -> AttemptRegistration:
        """Make a new start of a job the run's current attempt, and abandon what it discards.

        ``epoch`` is the attempt's fencing token from storage (>= 1, above every earlier one),
        ``attempt_id`` its uuid hex, ``host``/``pid``/``started_at`` its process,
        ``resumed_from`` the step it resumed from (None: a fresh start). In one transaction,
        holding the run row's update lock: refuse with ``FencedOutError`` (naming the
        current attempt) unless ``epoch`` is above the run's epoch; insert the attempt; set the
        run's epoch; and move every row of an older attempt above ``resumed_from`` (every step
        for a fresh start) that is pending, committed or failed to ``stale``. The step
        ``resumed_from`` itself stays. Fenced calls of older epochs are refused from then on.

        Without ``resumed_from`` the attempt is registered *undecided*: it fences older
        attempts at once and abandons nothing; ``decide_resume`` records its resume point
        later, once it has chosen under the fence (nothing an older attempt does can then move
        the ground under that choice).

        Calling it again for the current attempt (same epoch and attempt id, a retry) returns
        it with nothing abandoned. ``RunNotFoundError`` without the run.
        """
        run = validate.run_name(run)
        values = {
            "epoch": validate.epoch(epoch, minimum=1),
            "attempt_id": validate.token("attempt_id", attempt_id),
            "host": validate.host(host),
            "pid": validate.pid(pid),
            "started_at": validate.aware("started_at", started_at),
        }
        if resumed_from is not UNSET:
            values["resumed_from"] = validate.optional_step("resumed_from", resumed_from)
        action = f"register attempt {epoch} of run {run!r}"
        with self._run_transaction(action, run, lock="update") as transaction:
            row, abandoned, registered = attempts.register(
                transaction.session, self.url, transaction.run, values, utc_now()
            )
            if registered:
                detail = {k: v for k, v in values.items() if k != "started_at"}
                detail["started_at"] = started_at.isoformat()
                detail["abandoned"] = abandoned
                transaction.event("attempt_registered", detail=detail)
            return AttemptRegistration(AttemptRecord.of(row, run), tuple(abandoned))

    def decide_resume(
        self, run: str, *, epoch: int, resumed_from: int | None
    ) -> AttemptRegistration:
        """The current attempt ``epoch`` (registered undecided) resumes from ``resumed_from``
        (None: a fresh start). Fenced: ``FencedOutError`` unless ``epoch`` is current. In
        the same transaction every older attempt's pending, committed or failed row above it
        moves to ``stale``. Deciding the same again is a no-op; a different second decision
        raises ``InvalidValueError`` (a new resume point needs a new attempt)."""
        run = validate.run_name(run)
        epoch = validate.epoch(epoch, minimum=1)
        resumed_from = validate.optional_step("resumed_from", resumed_from)
        action = f"decide the resume point of run {run!r}"
        with self._run_transaction(action, run, lock="update") as transaction:
            row, abandoned, changed = attempts.decide(
                transaction.session, self.url, transaction.run, epoch, resumed_from, utc_now()
            )
            if changed:
                detail = {"epoch": epoch, "resumed_from": resumed_from, "abandoned": abandoned}
                transaction.event("resume_decided", detail=detail)
            return AttemptRegistration(AttemptRecord.of(row, run), tuple(abandoned))

    def current_attempt(self, run: str) -> AttemptRecord | None:
        """The run's current attempt; None if it never had a fenced one (epoch 0)."""
        run = validate.run_name(run)
        action = f"read the current attempt of run {run!r}"
        with self._run_transaction(action, run, write=False) as transaction:
            return attempts.current_record(transaction.session, transaction.run)

    def list_attempts(self, run: str) -> list[AttemptRecord]:
        """Every registered attempt of the run, ascending epoch."""
        run = validate.run_name(run)
        action = f"list attempts of run {run!r}"
        with self._run_transaction(action, run, write=False) as transaction:
            rows = attempts.all_of(transaction.session, transaction.run)
            return [AttemptRecord.of(row, run) for row in rows]
