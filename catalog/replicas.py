"""Timings and replicas: how long each phase of a save took, and which storage tiers hold a
checkpoint.

Internal to the catalog: the row work of ``Catalog``'s timings and replicas role
(``catalog.roles.replicas.ReplicaMethods``), run inside the transaction it opens.

- **Timings** (``checkpoints.timings``): phase name -> seconds of the save that committed the
  row (``catalog.validate.TIMING_PHASES``). ``mark_committed(timings=)`` records those known at
  the commit, ``add_timings`` merges those measured later (an async save's stall, an upload).
  ``checkpoints.stall_s`` mirrors ``timings["stall_s"]`` for the goodput reads: every statement
  that writes ``timings`` writes it too (``timing_values``, ``CLEARED_TIMINGS``).
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
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, cast, func, literal, select, type_coerce
from sqlalchemy.orm import Session

from zephon.catalog import guarded
from zephon.catalog.errors import (
    CheckpointRecordNotFoundError,
    InvalidTransitionError,
    ReplicaNotFoundError,
    StateConflictError,
    replica_label,
)
from zephon.catalog.models import Checkpoint, JsonDocument, Replica, ReplicaState, Run

__all__ = [
    "CLEARED_TIMINGS",
    "add_to_save",
    "delete_committed",
    "finish",
    "merge_timings",
    "of_run",
    "save_dir_copy_gone",
    "start",
    "timing_values",
]

PENDING = ReplicaState.PENDING
COMMITTED = ReplicaState.COMMITTED
FAILED = ReplicaState.FAILED
DELETED = ReplicaState.DELETED

_RETRIES = 5

#: the states ``replica_failed`` moves from, per tier (default: pending only). A committed
#: local copy is failed when it can never be uploaded (its attempt went stale): the copy is
#: still on the disk, but it is only a removable leftover now, and the row says why.
_FAILABLE: dict[str, tuple[ReplicaState, ...]] = {
    "local": (PENDING, COMMITTED),
    "memory": (PENDING, COMMITTED),
}

# What one save's copy recorded; re-arming clears it so nothing of the previous save survives.
_CLEARED_ON_REARM: dict[str, Any] = {
    "bytes": None,
    "timings": None,
    "failure_reason": None,
    "committed_at": None,
}


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


def delete_committed(
    session: Session, run_id: int, step: int, tier: str, host: str, now: datetime
) -> Replica | None:
    """``committed -> deleted`` for the replica of ``step`` on ``tier`` and ``host``; the row
    if it moved, else None (no committed row: none, pending, failed or deleted already)."""
    return guarded.update_one(
        session,
        Replica,
        [*_where(run_id, step, tier, host), Replica.state == COMMITTED],
        {"state": DELETED, "updated_at": now},
    )


def save_dir_copy_gone(session: Session, run_id: int, step: int, now: datetime) -> bool:
    """``committed -> deleted`` for the step's ``save_dir`` replica, in the transaction that
    marks its checkpoint row deleted (gc's delete, a marker found missing): the two say the
    same thing about the same copy, so they move together. True if a row moved."""
    return delete_committed(session, run_id, step, "save_dir", "", now) is not None


#: a checkpoint row's timings cleared (a re-arm, another save's marker recorded by a repair):
#: the document and the stall column that mirrors it
CLEARED_TIMINGS: dict[str, Any] = {"timings": None, "stall_s": None}


def timing_values(session: Session, timings: dict[str, float]) -> dict[str, Any]:
    """The values an ``UPDATE`` of a checkpoint row sets to merge ``timings`` into the row's
    (keys present are overwritten): ``timings`` as SQL, ``coalesce(timings, '{}') || :new``
    on PostgreSQL's JSONB, ``json_patch`` on SQLite, and ``stall_s`` when the merge sets the
    stall, so the column stays the document's ``stall_s``. One atomic ``UPDATE``, so two
    merges racing on a row never lose a phase, with no read and no lock of their own."""
    document = json.dumps(timings)
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import JSONB  # loaded with the dialect, not before

        empty = cast(literal("{}"), JSONB)
        merged = func.coalesce(Checkpoint.timings, empty).op("||")(cast(literal(document), JSONB))
    else:
        merged = func.json_patch(func.coalesce(Checkpoint.timings, "{}"), document)
    values: dict[str, Any] = {"timings": type_coerce(merged, JsonDocument)}
    if "stall_s" in timings:
        values["stall_s"] = timings["stall_s"]
    return values


def merge_timings(
    session: Session, conditions: list[ColumnElement[bool]], timings: dict[str, float]
) -> Checkpoint | None:
    """Merge ``timings`` into the checkpoint row matching ``conditions`` (one statement);
    the row, or None when none matched."""
    return guarded.update_one(session, Checkpoint, conditions, timing_values(session, timings))


def add_to_save(
    session: Session, url: str, run: Run, step: int, save_id: str, timings: dict[str, float]
) -> bool:
    """Merge ``timings`` into the row of save ``save_id`` at ``step``; True if there were any
    to merge (an empty mapping only checks that the row exists).
    ``CheckpointRecordNotFoundError`` when the step has no row, or a row of another save."""
    mine = [Checkpoint.run_id == run.id, Checkpoint.step == step, Checkpoint.save_id == save_id]
    if timings:
        row = merge_timings(session, mine, timings)
    else:
        row = session.scalars(select(Checkpoint).where(*mine)).one_or_none()
    if row is None:
        other = session.scalars(
            select(Checkpoint.save_id).where(Checkpoint.run_id == run.id, Checkpoint.step == step)
        ).one_or_none()
        raise CheckpointRecordNotFoundError(url, run.name, step, save_id=save_id, found_save=other)
    return bool(timings)


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
