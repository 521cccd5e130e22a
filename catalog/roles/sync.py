"""``Catalog``'s repairs from storage, the source of truth: promote a verified marker, and mark
rows whose marker is missing, corrupt or stale (``catalog.repairs`` holds the rules).

Each holds the run row's update lock: the lineage they check must not change before they
commit, and they may move a committed row into or out of retention's count.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from zephon.catalog import repairs, validate
from zephon.catalog.models import Checkpoint, Run
from zephon.catalog.records import CheckpointRecord
from zephon.catalog.repairs import SyncOutcome
from zephon.catalog.session_base import CatalogBase, utc_now

__all__ = ["MISSING_MARKER_REASON", "SyncMethods"]

MISSING_MARKER_REASON = "commit marker missing on storage"

#: ``repairs.mark_corrupt``/``mark_stale``: (session, run, step, save_id, reason, now) -> row
_MarkSave = Callable[[Session, Run, int, str, str, datetime], Checkpoint | None]


class SyncMethods(CatalogBase):
    """The sync-repair role of ``Catalog``: ``upsert_committed``, ``mark_missing``,
    ``mark_corrupt``, ``mark_stale``."""

    def upsert_committed(
        self,
        run: str,
        step: int,
        path: str,
        *,
        save_id: str,
        epoch: int,
        bytes: int | None,
        file_count: int | None,
        manifest_checksum: str | None,
        metadata: dict[str, Any] | None = None,
        committed_at: datetime | None = None,
        stored_bytes: int | None = None,
    ) -> tuple[CheckpointRecord | None, SyncOutcome]:
        """Storage holds a complete, verified marker of save ``save_id`` (attempt ``epoch``) at
        ``step``: make the catalog agree. Idempotent; used by the resume probe, gc and sync.

        Never promotes a marker whose attempt is unregistered (epoch above the run's) or whose
        ``(epoch, step)`` a newer attempt abandoned (it resumed from below ``step``, or started
        fresh): ``SyncOutcome.STALE``, and a row still holding that save live is made
        ``stale``. Otherwise: no row -> ``INSERTED``; pending with the same save, failed or
        deleted -> ``PROMOTED``; committed -> ``UNCHANGED`` or ``UPDATED`` (a different save's
        row takes the marker's save, epoch and facts: storage is the truth); pending with
        another save (a live newer save), stale, corrupt or deleting -> ``SKIPPED``.
        ``committed_at`` defaults to now; ``metadata=None`` keeps the row's.

        Holds the run row's update lock, like ``mark_missing``: the lineage it checks must not
        change before it commits, and it may take a committed row out of retention's count.
        """
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        epoch = validate.epoch(epoch)
        facts = {
            "path": validate.storage_url("path", path),
            **validate.checkpoint_facts(
                bytes, file_count, manifest_checksum, metadata, stored_bytes
            ),
        }
        if metadata is None:
            del facts["meta"]  # unknown here: keep what the row has
        if committed_at is not None:
            validate.aware("committed_at", committed_at)
        now = utc_now()
        action = f"sync run {run!r} step {step}"
        with self._run_transaction(action, run, lock="update") as transaction:
            row, outcome, changed = repairs.upsert_committed(
                transaction.session,
                transaction.run,
                step,
                save_id,
                epoch,
                facts,
                committed_at or now,
                now,
            )
            if changed:
                detail = {"path": path, "save_id": save_id, "epoch": epoch}
                event = "sync_staled" if outcome is SyncOutcome.STALE else f"sync_{outcome}"
                transaction.event(event, step, detail)
            return (CheckpointRecord.of(row, run) if row is not None else None), outcome

    def mark_missing(self, run: str, step: int, reason: str = MISSING_MARKER_REASON) -> bool:
        """``committed -> deleted`` for a checkpoint whose marker is gone from storage.

        For ``zephon sync``. Returns True if the row moved, False if it was not committed
        (pending rows may still be written; ``deleting`` ones belong to gc). The leftover
        payload, if any, has no marker and is removed by gc as an orphan.
        """
        run, step = validate.run_name(run), validate.step(step)
        reason = validate.reason("reason", reason)
        action = f"mark run {run!r} step {step} missing"
        with self._run_transaction(action, run, lock="update") as transaction:
            row = repairs.mark_missing(
                transaction.session, transaction.run, step, reason, utc_now()
            )
            if row is not None:
                transaction.event("marked_missing", step, {"reason": reason})
            return row is not None

    def mark_corrupt(self, run: str, step: int, save_id: str, reason: str) -> bool:
        """The stored checkpoint of save ``save_id`` failed verification: row -> ``corrupt``.

        Not fenced: any reader may find corruption. Moves the row of that save when it is
        pending, committed, failed, or deleted by sync (marker missing); ``reason`` goes to
        ``failure_reason``. A corrupt row is never latest, never counted by retention, and kept
        for inspection until gc deletes it with ``corrupt=True``; a new save of the step
        re-arms it. Returns True if the row moved; False if it holds another save, is already
        corrupt or stale, or is being (or was) deleted by gc, whose files are going or gone.
        Holds the run row's update lock, as ``mark_missing`` does.
        """
        return self._mark_bad(run, step, save_id, reason, "corrupt", repairs.mark_corrupt)

    def mark_stale(self, run: str, step: int, save_id: str, reason: str) -> bool:
        """The stored marker of save ``save_id`` belongs to a history the run's lineage
        abandoned (an attempt this catalog learnt of late, an unregistered epoch): row ->
        ``stale``. Never latest again; gc deletes it after the grace. Not fenced: any reader
        applying the lineage rule may find it. True if the row moved (pending, committed or
        failed rows of that save); False otherwise."""
        # The row keeps the first 2,000 characters of the reason, the event all of it.
        return self._mark_bad(
            run, step, save_id, reason, "stale", repairs.mark_stale, reason_limit=2000
        )

    def _mark_bad(
        self,
        run: str,
        step: int,
        save_id: str,
        reason: str,
        state: str,
        mark: _MarkSave,
        *,
        reason_limit: int | None = None,
    ) -> bool:
        """``mark_corrupt``/``mark_stale``: move the row of save ``save_id`` to ``state`` with
        ``mark`` (event ``marked_<state>``), storing ``reason`` cut to ``reason_limit``
        characters; True if it moved."""
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        reason = validate.reason("reason", reason)
        action = f"mark run {run!r} step {step} {state}"
        with self._run_transaction(action, run, lock="update") as transaction:
            stored = reason[:reason_limit]
            row = mark(transaction.session, transaction.run, step, save_id, stored, utc_now())
            if row is not None:
                detail = {"save_id": save_id, "reason": reason}
                transaction.event(f"marked_{state}", step, detail)
            return row is not None
