"""ORM models of the catalog: ``runs``, ``attempts``, ``checkpoints``, their
``checkpoint_replicas`` (one per storage tier a checkpoint is on) and the ``events`` log.

This module describes the schema that the newest Alembic revision in ``migrations/`` creates;
the two are kept equal by a test (``compare_metadata`` finds no difference). Changing a model
therefore always comes with a new revision (``alembic -c migrations/alembic.ini revision
--autogenerate``).

Only catalog modules use these classes; callers get the frozen records of ``catalog.records``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# The enums live in catalog.states (no SQLAlchemy there); imported here for the constraints,
# and still importable from this module.
from zephon.catalog.states import (
    CheckpointState,
    ReplicaState,
    ReplicaTier,
    RunKind,
    RunStatus,
)


def _in(column: str, enum: type[StrEnum]) -> str:
    values = ", ".join(f"'{member.value}'" for member in enum)
    return f"{column} IN ({values})"


class UtcDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python, whatever the backend.

    SQLite has no timezone type and returns naive values; normalising here means every caller
    can compare catalog timestamps with ``datetime.now(UTC)``. On SQLite the stored text has a
    fixed width, so comparisons in SQL (lease and grace cut-offs) order correctly as strings.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"catalog timestamps must be timezone-aware, got {value!r}")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class JsonDocumentType(TypeDecorator[Any]):
    """JSONB on PostgreSQL (indexable, compact); JSON text elsewhere. ``none_as_null`` stores
    Python None as SQL NULL rather than the JSON literal 'null', so "no metadata" is one thing.

    The PostgreSQL type is chosen per dialect (``load_dialect_impl``), not named in the model:
    SQLAlchemy's PostgreSQL dialect is then imported only by a process that connects to
    PostgreSQL, not by every ``zephon latest`` on a SQLite catalog."""

    impl = JSON(none_as_null=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> Any:
        if dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import JSONB

            return dialect.type_descriptor(JSONB(none_as_null=True))
        return dialect.type_descriptor(JSON(none_as_null=True))


JsonDocument = JsonDocumentType()

# Named constraints make Alembic revisions deterministic and let SQLite batch migrations
# find the constraints they must recreate.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    """A training or inference job; its checkpoints live under ``storage_url``.

    ``epoch`` is the fencing token of the run's current attempt (the newest registered row of
    ``attempts``); 0 means the run never had a fenced attempt. Fenced calls present their
    attempt's epoch and are refused unless it equals this one.
    """

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("name"),
        CheckConstraint(_in("kind", RunKind), name="kind"),
        CheckConstraint(_in("status", RunStatus), name="status"),
        CheckConstraint("num_to_keep IS NULL OR num_to_keep >= 1", name="num_to_keep"),
        CheckConstraint(
            "keep_every_steps IS NULL OR keep_every_steps >= 1", name="keep_every_steps"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    storage_url: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    total_steps: Mapped[int | None] = mapped_column(BigInteger)
    num_to_keep: Mapped[int | None] = mapped_column(Integer)
    keep_every_steps: Mapped[int | None] = mapped_column(BigInteger)
    config: Mapped[dict[str, Any] | None] = mapped_column(JsonDocument)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class Attempt(Base):
    """One start of a job for a run, mirrored from storage's create-only attempt objects.

    ``epoch`` is handed out by storage, monotonic per run, and is the fencing token;
    ``resumed_from`` is the step the attempt resumed from (None: a fresh start), meaningful once
    ``decided_at`` is set: an attempt is registered first (which fences older ones) and
    decides where it resumes after, so nothing an older one does can move under its decision.
    Rows are inserted by ``register_attempt``, in the transaction that moves ``runs.epoch``.
    """

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("run_id", "epoch"),
        CheckConstraint("epoch >= 1", name="epoch"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    epoch: Mapped[int] = mapped_column(BigInteger)
    attempt_id: Mapped[str] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    resumed_from: Mapped[int | None] = mapped_column(BigInteger)
    registered_at: Mapped[datetime] = mapped_column(UtcDateTime)
    decided_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class Checkpoint(Base):
    """One step of one run. ``(run_id, step)`` is unique; a re-save re-arms the same row.

    ``save_id`` identifies the ``begin_checkpoint`` call that armed the row, so a slow or
    crashed writer can never commit over a newer save; ``epoch`` is the attempt that armed it
    (0: unfenced). ``claimed_by``/``claimed_at`` are the deletion lease held while the row is
    ``deleting``.
    """

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "step"),
        # "Newest committed of run R" is a backward scan of this index that stops at the first
        # entry; listing a run's rows in one state uses the same index.
        Index("ix_checkpoints_run_id_state_step", "run_id", "state", "step"),
        # A run's rows per attempt in time order, carrying every column the dashboard's
        # goodput reads (``Catalog.save_summaries``, ``save_rows``): those reads are
        # index-only, whatever else a row holds; "the rows of attempt E from time T on" is
        # one range of it.
        Index(
            "ix_checkpoints_attempt_saves",
            "run_id",
            "epoch",
            "created_at",
            "committed_at",
            "step",
            "stall_s",
        ),
        CheckConstraint(_in("state", CheckpointState), name="state"),
        CheckConstraint("step >= 0", name="step"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    step: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(Text)
    save_id: Mapped[str] = mapped_column(String(64))
    epoch: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    # of ``bytes``, those the save stored itself: a deduplicated save's new chunks and plain
    # files (docs/dedup.md); null: a save that stored all of them
    stored_bytes: Mapped[int | None] = mapped_column(BigInteger)
    file_count: Mapped[int | None] = mapped_column(Integer)
    manifest_checksum: Mapped[str | None] = mapped_column(String(128))
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # "metadata" is reserved on declarative classes; the column keeps the documented name.
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JsonDocument)
    failure_reason: Mapped[str | None] = mapped_column(Text)
    # phase name -> seconds of the save that committed the row (``catalog.timings``)
    timings: Mapped[dict[str, Any] | None] = mapped_column(JsonDocument)
    # ``timings["stall_s"]`` as a column of its own, written with ``timings`` by every
    # statement that writes them (``catalog.replicas.timing_values``, ``CLEARED_TIMINGS``):
    # summing it over a run's rows reads no JSON
    stall_s: Mapped[float | None] = mapped_column(Double)
    claimed_by: Mapped[str | None] = mapped_column(String(255))
    claimed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    committed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class Replica(Base):
    """One copy of one checkpoint on one storage tier: ``(run_id, step, tier, host)`` is unique.

    A job with a local tier commits each save to a node-local disk first (``tier="local"``,
    one row per ``host``), then uploads it to its ``save_dir`` (``tier="save_dir"``, host
    ``""``). ``save_id`` is the save the row belongs to; ``location`` the replica's checkpoint
    URL (never with credentials); ``bytes`` and ``timings`` are those of that copy. Deleting a
    run's row deletes its replicas (``ON DELETE CASCADE``).
    """

    __tablename__ = "checkpoint_replicas"
    __table_args__ = (
        # The unique index also serves "replicas of a run by step" (its leading columns).
        UniqueConstraint("run_id", "step", "tier", "host"),
        CheckConstraint(_in("state", ReplicaState), name="state"),
        CheckConstraint(_in("tier", ReplicaTier), name="tier"),
        CheckConstraint("step >= 0", name="step"),
        # "a run's live copies on one tier" (a memory tier's nodes, a dashboard) without
        # reading the rows of every step the run ever had, which stay as ``deleted``
        Index("ix_checkpoint_replicas_run_id_tier_state", "run_id", "tier", "state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    tier: Mapped[str] = mapped_column(String(16))
    host: Mapped[str] = mapped_column(String(255))
    location: Mapped[str] = mapped_column(Text)
    save_id: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    timings: Mapped[dict[str, Any] | None] = mapped_column(JsonDocument)
    failure_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    committed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class Event(Base):
    """Audit log: who (``actor`` = user@host:pid) did what to which run/step, and when.

    ``run_name`` is a plain string, not a foreign key, so the log also records actions on runs
    that are not (or no longer) in the catalog.
    """

    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_run_name_at", "run_name", "at"),
        # Retention (``prune_events``) deletes the oldest events in batches, a range scan of
        # this index; the newest-first listing of all events reads it backwards.
        Index("ix_events_at", "at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime)
    actor: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(32))
    run_name: Mapped[str | None] = mapped_column(String(128))
    step: Mapped[int | None] = mapped_column(BigInteger)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JsonDocument)


CATALOG_TABLES = ("runs", "attempts", "checkpoints", "checkpoint_replicas", "events")
