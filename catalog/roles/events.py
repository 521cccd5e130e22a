"""``Catalog``'s audit log: record an event for something done outside the catalog, list
events, prune old ones (``catalog.audit`` writes and deletes them)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from zephon.catalog import audit, validate
from zephon.catalog.models import Event
from zephon.catalog.records import EventRecord
from zephon.catalog.session_base import CatalogBase, call_time

__all__ = ["PRUNE_BATCH", "EventMethods"]

#: events deleted per transaction by ``prune_events``: about 45 ms on PostgreSQL and 0.25 s on
#: SQLite (its write lock) in a 10M-event log, so savers wait at most that long for a batch
PRUNE_BATCH = 10_000


class EventMethods(CatalogBase):
    """The events role of ``Catalog``: ``record_event``, ``events``, ``prune_events``."""

    def record_event(
        self,
        action: str,
        *,
        run: str | None = None,
        step: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        """Append an event for something done outside the catalog (e.g. gc removed an orphan)."""
        validate.text("event action", action, maximum=32)
        if run is not None:
            validate.run_name(run)
        validate.optional_step("step", step)
        validate.json_document("detail", detail)
        with self._transaction(f"record event {action}", run=run) as transaction:
            transaction.event(action, step, detail)

    def events(self, *, run: str | None = None, limit: int = 100) -> list[EventRecord]:
        """The newest ``limit`` events, newest first, optionally of one run."""
        validate.limit(limit)
        statement = select(Event).order_by(Event.at.desc(), Event.id.desc()).limit(limit)
        if run is not None:
            statement = statement.where(Event.run_name == validate.run_name(run))
        with self._transaction("list events", write=False) as transaction:
            return [EventRecord.of(row) for row in transaction.session.scalars(statement)]

    def prune_events(
        self,
        *,
        older_than: timedelta,
        now: datetime | None = None,
        batch_size: int = PRUNE_BATCH,
    ) -> int:
        """Delete the events older than ``now - older_than``; returns how many were deleted.

        Deletes in batches of ``batch_size`` (oldest first), each its own transaction, so a
        huge log never becomes one giant transaction and other writers (jobs saving, gc) get
        the database between batches. The last batch's transaction records one
        ``events_pruned`` event (detail: ``before``, the cut-off; ``deleted``; ``batches``), so
        the log says when it was pruned, and that event is newer than the cut-off it names.
        A crash part-way leaves the batches done deleted and no ``events_pruned`` event;
        calling again finishes the job. For ``zephon gc``; any process may call it at any time.
        """
        validate.duration("older_than", older_than)
        validate.integer("batch_size", batch_size, minimum=1, maximum=1_000_000)
        cutoff = call_time(now) - older_than
        deleted, batches = 0, 0
        while True:
            with self._transaction("prune events") as transaction:
                count = audit.delete_before(transaction.session, cutoff, batch_size)
                deleted, batches = deleted + count, batches + 1
                if count < batch_size:
                    detail = {
                        "before": cutoff.isoformat(),
                        "deleted": deleted,
                        "batches": batches,
                    }
                    transaction.event("events_pruned", detail=detail)
                    return deleted
