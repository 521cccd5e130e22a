"""Timings and replicas: how long each phase of a save took, and which storage tiers hold a
checkpoint.

Two things live here, both mixed into ``Catalog`` (``ReplicaMethods``), whose methods they
are; ``catalog.py`` keeps the rest of the facade.

- **Timings** (``checkpoints.timings``): phase name -> seconds of the save that committed the
  row (``catalog.validate.TIMING_PHASES``). ``mark_committed(timings=)`` records those known at
  the commit, ``add_timings`` merges those measured later (an async save's stall, an upload).
- **Replicas** (``checkpoint_replicas``): one row per copy of a checkpoint on a tier, unique
  per ``(run, step, tier, host)``. A job with a local tier commits each save to a node-local
  disk (``tier="local"``, one row per host), then a background uploader copies it to the
  job's ``save_dir`` (``tier="save_dir"``, host ``""``)::

      (none) --started--> pending --committed--> committed --deleted--> deleted
                          pending --failed-----> failed
      committed (tier "local" only: a copy that can never be uploaded) --failed--> failed
      failed | deleted --started (a retry of the save, or a new save)--> pending
      pending | committed of another save --started (a new save of the step)--> pending

Every transition is one guarded ``UPDATE ... WHERE state = <expected> AND save_id = <mine>
RETURNING``, as in ``catalog.transitions``: the database decides who wins a race (an old
save's upload committing while a new save of the step re-arms the row), and a lost guard is
re-read to say why. Each transition records an event (``replica_begun``, ``replica_rearmed``,
``replica_committed``, ``replica_failed``, ``replica_deleted``; ``timings_added``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, Select, cast, func, literal, select, type_coerce
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from catalog import guarded, runs, validate
from catalog.errors import (
    CheckpointRecordNotFoundError,
    InvalidTransitionError,
    InvalidValueError,
    ReplicaNotFoundError,
    StateConflictError,
    replica_label,
)
from catalog.models import Checkpoint, JsonDocument, Replica, ReplicaState, Run
from catalog.records import ReplicaRecord

__all__ = ["ReplicaMethods", "merge_timings", "merged_timings", "save_dir_copy_gone"]

PENDING = ReplicaState.PENDING
COMMITTED = ReplicaState.COMMITTED
FAILED = ReplicaState.FAILED
DELETED = ReplicaState.DELETED

_RETRIES = 5

#: the states ``replica_failed`` moves from, per tier (default: pending only). A committed
#: local copy is failed when it can never be uploaded (its attempt went stale): the copy is
#: still on the disk, but it is only a removable leftover now, and the row says why.
_FAILABLE: dict[str, tuple[ReplicaState, ...]] = {"local": (PENDING, COMMITTED)}

# What one save's copy recorded; re-arming clears it so nothing of the previous save survives.
_CLEARED_ON_REARM: dict[str, Any] = {
    "bytes": None,
    "timings": None,
    "failure_reason": None,
    "committed_at": None,
}


def _now() -> datetime:
    return datetime.now(UTC)


def _where(
    run_id: int, step: int, tier: str | None = None, host: str | None = None
) -> list[ColumnElement[bool]]:
    conditions = [Replica.run_id == run_id, Replica.step == step]
    if tier is not None:
        conditions.append(Replica.tier == tier)
    if host is not None:
        conditions.append(Replica.host == host)
    return conditions


def _load(session: Session, run_id: int, step: int, tier: str, host: str) -> Replica | None:
    return guarded.reread(session, select(Replica).where(*_where(run_id, step, tier, host)))


def save_dir_copy_gone(session: Session, run_id: int, step: int, now: datetime) -> bool:
    """``committed -> deleted`` for the step's ``save_dir`` replica, in the transaction that
    marks its checkpoint row deleted (gc's delete, a marker found missing): the two say the
    same thing about the same copy, so they move together. True if a row moved."""
    moved = guarded.update_one(
        session,
        Replica,
        [*_where(run_id, step, "save_dir", ""), Replica.state == COMMITTED],
        {"state": DELETED, "updated_at": now},
    )
    return moved is not None


def merged_timings(session: Session, timings: dict[str, float]) -> ColumnElement[Any]:
    """SQL for "the row's timings with ``timings`` merged in" (keys present are
    overwritten): ``coalesce(timings, '{}') || :new`` on PostgreSQL's JSONB, ``json_patch``
    on SQLite. One atomic ``UPDATE ... SET timings = <this>``, so two merges racing on a row
    never lose a phase, with no read and no lock of their own."""
    document = json.dumps(timings)
    if session.get_bind().dialect.name == "postgresql":
        empty = cast(literal("{}"), JSONB)
        merged = func.coalesce(Checkpoint.timings, empty).op("||")(cast(literal(document), JSONB))
        return type_coerce(merged, JsonDocument)
    return type_coerce(
        func.json_patch(func.coalesce(Checkpoint.timings, "{}"), document), JsonDocument
    )


def merge_timings(
    session: Session, conditions: list[ColumnElement[bool]], timings: dict[str, float]
) -> Checkpoint | None:
    """Merge ``timings`` into the checkpoint row matching ``conditions`` (one statement);
    the row, or None when none matched."""
    return guarded.update_one(
        session, Checkpoint, conditions, {"timings": merged_timings(session, timings)}
    )


def start(
    session: Session,
    url: str,
    run: Run,
    step: int,
    values: dict[str, str],
    now: datetime,
) -> tuple[Replica, str | None, dict[str, Any] | None]:
    """Arm the replica ``pending`` for save ``values["save_id"]``.

    Returns ``(row, action, previous)``: action ``replica_begun`` (a new row),
    ``replica_rearmed`` (``previous`` is the state and save it had) or None (already pending
    for this save: a retry).
    """
    tier, host, save_id = values["tier"], values["host"], values["save_id"]
    for _ in range(_RETRIES):
        row = _load(session, run.id, step, tier, host)
        if row is None:
            fresh = guarded.insert(
                session,
                Replica(
                    run_id=run.id,
                    step=step,
                    state=PENDING,
                    created_at=now,
                    updated_at=now,
                    **values,
                ),
            )
            if fresh is not None:
                return fresh, "replica_begun", None
            continue  # a concurrent start inserted the row: decide again on what it holds
        if row.save_id == save_id and row.state == PENDING:
            return row, None, None
        if row.save_id == save_id and row.state == COMMITTED:
            raise InvalidTransitionError(
                url,
                run.name,
                step,
                row.state,
                f"start the {replica_label(tier, host)} of",
                f"save {save_id}'s copy is committed already; a new save of the step comes "
                f"with a new save id",
            )
        previous = {"state": row.state, "save_id": row.save_id}
        moved = guarded.update_one(
            session,
            Replica,
            guarded.unchanged(Replica, row),
            {
                **_CLEARED_ON_REARM,
                **values,
                "state": PENDING,
                "created_at": now,
                "updated_at": now,
            },
        )
        if moved is not None:
            return moved, "replica_rearmed", previous
    action = f"start the {replica_label(tier, host)} of"
    raise InvalidTransitionError.contended(url, run.name, step, action, _RETRIES, "saves")


def finish(
    session: Session,
    url: str,
    run: Run,
    step: int,
    tier: str,
    host: str,
    save_id: str,
    target: ReplicaState,
    values: dict[str, Any],
) -> tuple[Replica, bool]:
    """``pending -> target`` (committed or failed) for this save; ``(row, moved)``; also
    ``committed -> failed`` for a ``local`` replica (``_FAILABLE``). Idempotent for the same
    save; ``StateConflictError`` when another save re-armed the row, ``InvalidTransitionError``
    when this save's row is in another state."""
    verb = "commit" if target == COMMITTED else "fail"
    sources = _FAILABLE.get(tier, (PENDING,)) if target == FAILED else (PENDING,)
    moved = guarded.update_one(
        session,
        Replica,
        [
            *_where(run.id, step, tier, host),
            Replica.state.in_(sources),
            Replica.save_id == save_id,
        ],
        {**values, "state": target},
    )
    if moved is not None:
        return moved, True
    row = _load(session, run.id, step, tier, host)
    action = f"{verb} the {replica_label(tier, host)} of"
    if row is None:
        raise ReplicaNotFoundError(url, run.name, step, tier, host)
    if row.save_id != save_id:
        raise StateConflictError(url, run.name, step, row.state, action, save_id, row.save_id)
    if row.state == target:
        return row, False
    which = " or ".join(str(s) for s in sources)
    raise InvalidTransitionError(
        url,
        run.name,
        step,
        row.state,
        action,
        f"only a {which} replica is {target}; a new save of the step re-arms it with "
        f"replica_started",
    )


def of_run(
    run_id: int,
    step: int | None,
    tier: str | None,
    host: str | None,
    states: list[str] | None,
) -> Select[tuple[Replica]]:
    """A run's replicas by step, then tier, then host (the unique index's order)."""
    statement = select(Replica).where(Replica.run_id == run_id)
    if step is not None:
        statement = statement.where(Replica.step == step)
    if tier is not None:
        statement = statement.where(Replica.tier == tier)
    if host is not None:
        statement = statement.where(Replica.host == host)
    if states is not None:
        statement = statement.where(Replica.state.in_(states))
    return statement.order_by(Replica.step, Replica.tier, Replica.host)


class ReplicaMethods:
    """``Catalog``'s timing and replica methods (mixed into ``Catalog``, which provides
    ``_db``, ``url`` and ``_event``)."""

    _db: Any
    url: str

    if TYPE_CHECKING:

        def _event(
            self,
            session: Any,
            action: str,
            run: str | None = None,
            step: int | None = None,
            detail: dict[str, Any] | None = None,
        ) -> None: ...

    # -- timings -----------------------------------------------------------------------------

    def add_timings(self, run: str, step: int, save_id: str, timings: Mapping[str, float]) -> None:
        """Merge phases into the row of save ``save_id`` (keys already there are overwritten):
        for phases measured after the commit, such as an async save's stall or the upload of
        a local save. Any state; ``CheckpointRecordNotFoundError`` when the step has no row or a row
        of another save (``found_save``: a newer save re-armed it). Phases are those of
        ``catalog.validate.TIMING_PHASES``, finite seconds >= 0 (``InvalidValueError``
        otherwise). Does not touch ``updated_at`` (retention's clock for stale rows)."""
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        checked = validate.timings(timings)
        if checked is None:
            raise InvalidValueError(
                "timings", timings, "expected a mapping of phase name to seconds"
            )
        with self._db.write(f"add timings to run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            mine = [
                Checkpoint.run_id == owner.id,
                Checkpoint.step == step,
                Checkpoint.save_id == save_id,
            ]
            if checked:
                row = merge_timings(session, mine, checked)
            else:
                row = session.scalars(select(Checkpoint).where(*mine)).one_or_none()
            if row is None:
                other = session.scalars(
                    select(Checkpoint.save_id).where(
                        Checkpoint.run_id == owner.id, Checkpoint.step == step
                    )
                ).one_or_none()
                raise CheckpointRecordNotFoundError(
                    self.url, run, step, save_id=save_id, found_save=other
                )
            if checked:
                self._event(
                    session, "timings_added", run, step, {"save_id": save_id, "timings": checked}
                )

    # -- replicas ----------------------------------------------------------------------------

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
        with self._db.write(f"start a {tier} replica of run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row, action, previous = start(session, self.url, owner, step, values, _now())
            if action is not None:
                detail: dict[str, Any] = dict(values)
                if previous is not None:
                    detail["previous"] = previous
                self._event(session, action, run, step, detail)
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
        now = _now()
        values = {
            "bytes": size,
            "timings": checked or None,
            "failure_reason": None,
            "committed_at": now,
            "updated_at": now,
        }
        with self._db.write(f"commit a {tier} replica of run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row, moved = finish(
                session, self.url, owner, step, tier, host, save_id, COMMITTED, values
            )
            if moved:
                detail = {"tier": tier, "host": host, "save_id": save_id, "bytes": size}
                if checked:
                    detail["timings"] = checked
                self._event(session, "replica_committed", run, step, detail)
            return ReplicaRecord.of(row, run)

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
        values = {"failure_reason": reason, "updated_at": _now()}
        with self._db.write(f"fail a {tier} replica of run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row, moved = finish(session, self.url, owner, step, tier, host, save_id, FAILED, values)
            if moved:
                detail = {"tier": tier, "host": host, "save_id": save_id, "reason": reason}
                self._event(session, "replica_failed", run, step, detail)
            return ReplicaRecord.of(row, run)

    def replica_deleted(self, run: str, step: int, *, tier: str, host: str) -> bool:
        """``committed -> deleted`` once the copy is removed from ``tier`` (a local disk's
        retention, gc). True if the row moved; False if there is no committed row (none, or
        pending, failed, already deleted): deleting twice is harmless."""
        run, step = validate.run_name(run), validate.step(step)
        tier = validate.tier(tier)
        host = validate.replica_host(tier, host)
        with self._db.write(f"delete a {tier} replica of run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row = guarded.update_one(
                session,
                Replica,
                [*_where(owner.id, step, tier, host), Replica.state == COMMITTED],
                {"state": DELETED, "updated_at": _now()},
            )
            if row is not None:
                detail = {"tier": tier, "host": host, "save_id": row.save_id}
                self._event(session, "replica_deleted", run, step, detail)
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
        with self._db.read(f"list replicas of run {run!r}") as session:
            owner = runs.require(session, self.url, run)
            statement = of_run(owner.id, step, tier, host, wanted)
            return [ReplicaRecord.of(row, run) for row in session.scalars(statement)]
