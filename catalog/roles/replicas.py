"""``Catalog``'s timings and replicas: phases measured after a save's commit, and the copies
of a checkpoint per storage tier (``catalog.replicas`` holds the state machine and the
timing merge; docs/catalog.md, Timings and replicas)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from zephon.catalog import audit, replicas, validate
from zephon.catalog.errors import InvalidValueError
from zephon.catalog.models import ReplicaState
from zephon.catalog.records import ReplicaRecord
from zephon.catalog.session_base import CatalogBase, utc_now

__all__ = ["ReplicaMethods"]


class ReplicaMethods(CatalogBase):
    """The timings and replicas role of ``Catalog``: ``add_timings``, ``replica_started``,
    ``replica_committed``, ``replica_failed``, ``replica_deleted``, ``replicas``."""

    def add_timings(self, run: str, step: int, save_id: str, timings: Mapping[str, float]) -> None:
        """Merge phases into the row of save ``save_id`` (keys already there are overwritten):
        for phases measured after the commit, such as an async save's stall or the upload of
        a local save. Any state; ``CheckpointRecordNotFoundError`` when the step has no row or
        a row of another save (``found_save``: a newer save re-armed it). Phases are those of
        ``catalog.validate.TIMING_PHASES``, finite seconds >= 0 (``InvalidValueError``
        otherwise). Does not touch ``updated_at`` (retention's clock for stale rows)."""
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        checked = validate.timings(timings)
        if checked is None:
            raise InvalidValueError(
                "timings", timings, "expected a mapping of phase name to seconds"
            )
        action = f"add timings to run {run!r} step {step}"
        with self._run_transaction(action, run) as transaction:
            if replicas.add_to_save(
                transaction.session, self.url, transaction.run, step, save_id, checked
            ):
                transaction.event("timings_added", step, {"save_id": save_id, "timings": checked})

    def replica_started(
        self, run: str, step: int, *, tier: str, host: str, location: str, save_id: str
    ) -> ReplicaRecord:
        """A copy of save ``save_id`` of ``step`` is being written to ``tier`` on ``host``
        (``""`` for ``save_dir``) at ``location`` (its checkpoint URL, credentials masked:
        one with a password is refused). Creates the row ``pending``, or re-arms it,
        clearing what the earlier attempt recorded: a ``failed`` or ``deleted`` row (a
        retried upload of the same save, or a new save), a ``pending`` or ``committed`` row
        of another save (a new save of that step). Idempotent while the row is pending for
        this save; ``InvalidTransitionError`` if this save's replica is committed already.
        ``RunNotFoundError`` without the run."""
        run, step = validate.run_name(run), validate.step(step)
        tier = validate.tier(tier)
        values = {
            "tier": tier,
            "host": validate.replica_host(tier, host),
            "location": validate.storage_url("location", location),
            "save_id": validate.token("save_id", save_id),
        }
        action = f"start a {tier} replica of run {run!r} step {step}"
        with self._run_transaction(action, run) as transaction:
            row, event, previous = replicas.start(
                transaction.session, self.url, transaction.run, step, values, utc_now()
            )
            if event is not None:
                transaction.event(event, step, audit.with_previous(dict(values), previous))
            return ReplicaRecord.of(row, run)

    def replica_committed(
        self,
        run: str,
        step: int,
        *,
        tier: str,
        host: str,
        save_id: str,
        bytes: int,
        timings: Mapping[str, float] | None = None,
    ) -> ReplicaRecord:
        """``pending -> committed``: the copy of save ``save_id`` is complete on ``tier``
        (its marker exists there), ``bytes`` long; ``timings`` are its phases (``local_s``,
        ``upload_s``...). Idempotent for the same save. ``StateConflictError`` (an
        ``InvalidTransitionError``) when another save re-armed the row since (the upload
        of an older save finished late), ``InvalidTransitionError`` when this save's row is
        failed or deleted, ``ReplicaNotFoundError`` (a ``CheckpointRecordNotFoundError``)
        without ``replica_started``."""
        run, step = validate.run_name(run), validate.step(step)
        tier = validate.tier(tier)
        host = validate.replica_host(tier, host)
        save_id = validate.token("save_id", save_id)
        size = validate.integer("bytes", bytes, minimum=0)
        checked = validate.timings(timings)
        now = utc_now()
        values = {
            "bytes": size,
            "timings": checked or None,
            "failure_reason": None,
            "committed_at": now,
            "updated_at": now,
        }
        detail: dict[str, Any] = {"tier": tier, "host": host, "save_id": save_id, "bytes": size}
        if checked:
            detail["timings"] = checked
        action = f"commit a {tier} replica of run {run!r} step {step}"
        return self._finish_replica(
            action, run, step, save_id, ReplicaState.COMMITTED, values, detail
        )

    def replica_failed(
        self, run: str, step: int, *, tier: str, host: str, save_id: str, reason: str
    ) -> ReplicaRecord:
        """``pending -> failed``: the copy of save ``save_id`` could not be completed
        (``reason``, stored as ``failure_reason``); for ``tier="local"`` also ``committed ->
        failed``: a local copy that can never be uploaded (its attempt went stale). Idempotent
        for the same save; errors as ``replica_committed`` (another committed replica is not
        failed: ``replica_deleted``)."""
        run, step = validate.run_name(run), validate.step(step)
        tier = validate.tier(tier)
        host = validate.replica_host(tier, host)
        save_id = validate.token("save_id", save_id)
        reason = validate.reason("reason", reason)[:2000]
        values = {"failure_reason": reason, "updated_at": utc_now()}
        detail = {"tier": tier, "host": host, "save_id": save_id, "reason": reason}
        action = f"fail a {tier} replica of run {run!r} step {step}"
        return self._finish_replica(action, run, step, save_id, ReplicaState.FAILED, values, detail)

    def _finish_replica(
        self,
        action: str,
        run: str,
        step: int,
        save_id: str,
        target: ReplicaState,
        values: dict[str, Any],
        detail: dict[str, Any],
    ) -> ReplicaRecord:
        """``replica_committed``/``replica_failed``: move the replica of save ``save_id``
        named by ``detail``'s tier and host to ``target`` with ``values``; on a move, the
        event ``replica_<target>`` with ``detail``."""
        tier, host = detail["tier"], detail["host"]
        with self._run_transaction(action, run) as transaction:
            row, moved = replicas.finish(
                transaction.session,
                self.url,
                transaction.run,
                step,
                tier,
                host,
                save_id,
                target,
                values,
            )
            if moved:
                transaction.event(f"replica_{target}", step, detail)
            return ReplicaRecord.of(row, run)

    def replica_deleted(self, run: str, step: int, *, tier: str, host: str) -> bool:
        """``committed -> deleted`` once the copy is removed from ``tier`` (a local disk's
        retention, gc). True if the row moved; False if there is no committed row (none, or
        pending, failed, already deleted): deleting twice is harmless."""
        run, step = validate.run_name(run), validate.step(step)
        tier = validate.tier(tier)
        host = validate.replica_host(tier, host)
        action = f"delete a {tier} replica of run {run!r} step {step}"
        with self._run_transaction(action, run) as transaction:
            row = replicas.delete_committed(
                transaction.session, transaction.run.id, step, tier, host, utc_now()
            )
            if row is not None:
                detail = {"tier": tier, "host": host, "save_id": row.save_id}
                transaction.event("replica_deleted", step, detail)
            return row is not None

    def replicas(
        self,
        run: str,
        *,
        step: int | None = None,
        tier: str | None = None,
        host: str | None = None,
        states: Iterable[str] | None = None,
    ) -> list[ReplicaRecord]:
        """The run's replicas, ordered by step, then tier, then host; optionally only of one
        ``step``, ``tier``, ``host`` or in ``states``. One query on the unique index
        ``(run_id, step, tier, host)``. ``RunNotFoundError`` without the run."""
        run = validate.run_name(run)
        if step is not None:
            step = validate.step(step)
        if tier is not None:
            tier = validate.tier(tier)
        if host is not None:
            host = validate.text("host", host, maximum=255, empty=True)
        wanted = validate.replica_states(states)
        action = f"list replicas of run {run!r}"
        with self._run_transaction(action, run, write=False) as transaction:
            statement = replicas.of_run(transaction.run.id, step, tier, host, wanted)
            return [ReplicaRecord.of(row, run) for row in transaction.session.scalars(statement)]
