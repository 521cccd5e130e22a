"""``Catalog``'s save path: arm a step ``pending``, then mark it ``committed`` or ``failed``
(``catalog.transitions`` holds the state machine, ``catalog.attempts`` the fence)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zephon.catalog import attempts, audit, replicas, transitions, validate
from zephon.catalog.models import Checkpoint
from zephon.catalog.records import CheckpointRecord
from zephon.catalog.session_base import CatalogBase, utc_now

__all__ = ["SaveMethods"]


class SaveMethods(CatalogBase):
    """The save-path role of ``Catalog``: ``begin_checkpoint``, ``mark_committed``,
    ``mark_failed``."""

    def begin_checkpoint(
        self, run: str, step: int, path: str, *, epoch: int = 0, save_id: str | None = None
    ) -> CheckpointRecord:
        """Arm ``(run, step)`` as ``pending`` before writing it; the record's ``save_id`` is
        what ``mark_committed``/``mark_failed`` need.

        Fenced: refused with ``FencedOutError`` unless ``epoch`` is the run's current epoch
        (epoch 0 works only while the run never had a fenced attempt). ``save_id`` (1-64
        characters of ``[A-Za-z0-9_-]``) names the save, e.g. the id storage writes into the
        marker; without it one is generated. The row records ``epoch``.

        A missing row is created; a ``failed``, ``deleted``, ``stale``, ``corrupt`` or
        ``pending`` one (a crashed earlier save) is re-armed under the new save id, which makes
        the older save's later ``mark_committed`` fail with ``StateConflictError``; the event's
        ``previous`` keeps what the row was. Raises ``CheckpointExistsError`` for a
        ``committed`` step (never overwritten) and ``InvalidTransitionError`` for one gc is
        deleting; ``RunNotFoundError`` without the run.
        """
        run, step = validate.run_name(run), validate.step(step)
        path = validate.storage_url("path", path)
        epoch = validate.epoch(epoch)
        if save_id is not None:
            save_id = validate.token("save_id", save_id)
        action = f"begin run {run!r} step {step}"
        with self._run_transaction(action, run, lock="share") as transaction:
            session, owner = transaction.session, transaction.run
            attempts.check_current(session, self.url, owner, epoch)
            row, event, previous = transitions.begin(
                session, self.url, owner, step, path, epoch, save_id, utc_now()
            )
            detail = {"save_id": row.save_id, "epoch": epoch, "path": path}
            transaction.event(event, step, audit.with_previous(detail, previous))
            return CheckpointRecord.of(row, run)

    def mark_committed(
        self,
        run: str,
        step: int,
        save_id: str,
        *,
        epoch: int = 0,
        bytes: int | None,
        file_count: int | None,
        manifest_checksum: str | None,
        metadata: dict[str, Any] | None = None,
        timings: Mapping[str, float] | None = None,
        stored_bytes: int | None = None,
    ) -> CheckpointRecord:
        """``pending -> committed`` after the commit marker is written, for this save only.
        ``stored_bytes``: of ``bytes``, those the save stored itself (a deduplicated save).

        ``timings`` (phase name -> seconds: ``write_s``, ``commit_s``, ``total_s``,
        ``stall_s``...; ``catalog.validate.TIMING_PHASES``) are merged into the row's, in the
        same transaction, also when the call is an idempotent repeat.

        Idempotent: if the row is already committed by the same save (a retry, or the marker
        probe promoted it), returns it unchanged, even if a newer attempt has registered since
        (the commit happened while this attempt was current). Otherwise fenced like
        ``begin_checkpoint``: ``FencedOutError`` unless ``epoch`` is the run's current
        epoch. Raises ``StateConflictError`` when the row is no longer this save's pending row
        (re-armed by a newer save, failed by gc after the grace period),
        ``InvalidTransitionError`` when the save was begun by another attempt (only the
        attempt that began a save commits it), ``CheckpointRecordNotFoundError`` without a row.
        """
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        epoch = validate.epoch(epoch)
        facts = validate.checkpoint_facts(
            bytes, file_count, manifest_checksum, metadata, stored_bytes
        )
        phases = validate.timings(timings)
        action = f"commit run {run!r} step {step}"
        with self._run_transaction(action, run, lock="share") as transaction:
            session, owner = transaction.session, transaction.run
            done = transitions.committed_by(session, owner.id, step, save_id)
            if done is not None:
                if phases:
                    done = replicas.merge_timings(session, [Checkpoint.id == done.id], phases)
                return CheckpointRecord.of(done, run)
            attempts.check_current(session, self.url, owner, epoch)
            if phases:  # merged in the commit's own guarded UPDATE
                facts.update(replicas.timing_values(session, phases))
            row, moved = transitions.commit(
                session, self.url, owner, step, save_id, epoch, facts, utc_now()
            )
            if moved:
                detail: dict[str, Any] = {
                    "save_id": save_id,
                    "epoch": epoch,
                    "bytes": bytes,
                    "file_count": file_count,
                    "manifest_checksum": manifest_checksum,
                }
                if phases:
                    detail["timings"] = phases
                transaction.event("committed", step, detail)
            return CheckpointRecord.of(row, run)

    def mark_failed(self, run: str, step: int, save_id: str, reason: str) -> CheckpointRecord:
        """``pending -> failed`` for this save: the save failed, or gc expired a stale row.

        Not fenced: failing one's own pending row is harmless whatever attempt is current.
        Idempotent for the same save; ``StateConflictError`` if the row moved on (committed,
        re-armed by a newer save, or made stale by a newer attempt). The directory left behind
        has no marker and is removed by gc as an orphan.
        """
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        reason = validate.reason("reason", reason, empty=True)
        with self._run_transaction(f"fail run {run!r} step {step}", run) as transaction:
            row, moved = transitions.fail(
                transaction.session, self.url, transaction.run, step, save_id, reason, utc_now()
            )
            if moved:
                transaction.event("failed", step, {"save_id": save_id, "reason": reason})
            return CheckpointRecord.of(row, run)
