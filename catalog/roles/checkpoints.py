"""``Catalog``'s checkpoint queries: the latest committed row, rows after a step, a run's rows
by state, one step's row (``catalog.queries`` holds the statements)."""

from __future__ import annotations

from collections.abc import Sequence

from zephon.catalog import queries, runs, transitions, validate
from zephon.catalog.errors import CheckpointRecordNotFoundError, InvalidValueError
from zephon.catalog.models import CheckpointState
from zephon.catalog.records import CheckpointRecord
from zephon.catalog.session_base import CatalogBase

__all__ = ["CheckpointQueryMethods"]


class CheckpointQueryMethods(CatalogBase):
    """The checkpoint-query role of ``Catalog``; read-only."""

    def latest_committed(self, run: str) -> CheckpointRecord | None:
        """The newest committed checkpoint of ``run`` (highest step), or None.

        One indexed query (a backward scan of ``(run_id, state, step)`` stopping at the first
        entry); a second query only when there is none, to tell an unknown run
        (``RunNotFoundError``) from a run without committed checkpoints (None).
        """
        run = validate.run_name(run)
        statement = queries.latest_committed(run)
        action = f"find the latest checkpoint of run {run!r}"
        # Not a run transaction: the run row is read only when there is no checkpoint.
        with self._transaction(action, write=False) as transaction:
            row = transaction.session.scalars(statement).first()
            if row is not None:
                return CheckpointRecord.of(row, run)
            runs.require(transaction.session, self.url, run)
            return None

    def rows_after(
        self, run: str, step: int | None, *, states: str | Sequence[str]
    ) -> list[CheckpointRecord]:
        """Rows in ``states`` with a step above ``step`` (every step if None), newest first.

        For the marker probe on resume: pass the latest committed step and the states
        pending, failed and deleted; a row whose verified marker exists on storage is repaired
        with ``upsert_committed`` (the marker's save id and epoch).
        """
        run = validate.run_name(run)
        if step is not None:
            step = validate.step(step)
        wanted = validate.states(states)
        if not wanted:
            raise InvalidValueError("states", states, "expected at least one state")
        action = f"list checkpoints of run {run!r} after step {step}"
        with self._run_transaction(action, run, write=False) as transaction:
            statement = queries.rows_after(transaction.run.id, step, wanted)
            rows = transaction.session.scalars(statement)
            return [CheckpointRecord.of(row, run) for row in rows]

    def pending_after(self, run: str, step: int | None) -> list[CheckpointRecord]:
        """``rows_after(run, step, states=["pending"])``."""
        return self.rows_after(run, step, states=[CheckpointState.PENDING])

    def list_checkpoints(
        self, run: str, *, states: str | Sequence[str] | None = None
    ) -> list[CheckpointRecord]:
        """The run's checkpoints in ascending step order, optionally only in ``states``."""
        run = validate.run_name(run)
        wanted = validate.states(states)
        action = f"list checkpoints of run {run!r}"
        with self._run_transaction(action, run, write=False) as transaction:
            statement = queries.checkpoints_of(transaction.run.id, wanted)
            rows = transaction.session.scalars(statement)
            return [CheckpointRecord.of(row, run) for row in rows]

    def get_checkpoint(self, run: str, step: int) -> CheckpointRecord:
        """One checkpoint row in any state (``CheckpointRecordNotFoundError`` if none)."""
        run, step = validate.run_name(run), validate.step(step)
        action = f"read run {run!r} step {step}"
        with self._run_transaction(action, run, write=False) as transaction:
            row = transitions.load(transaction.session, transaction.run.id, step)
            if row is None:
                raise CheckpointRecordNotFoundError(self.url, run, step)
            return CheckpointRecord.of(row, run)
