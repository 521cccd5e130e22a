"""Zephon's SQL catalog of runs and checkpoints (SQLite embedded, PostgreSQL in production).

The catalog is an index: storage holds the bytes and the commit markers, the catalog answers
"latest complete checkpoint of run R" with one indexed query, keeps the retention policy, and
coordinates deletions between jobs and gc processes. It never imports fsspec, torch,
``storage`` or ``zephon``; the ``zephon`` package composes it with storage.

Start with ``Catalog`` (docs/catalog.md describes the tables, states and protocols).
"""

from __future__ import annotations

from zephon.catalog.catalog import DEFAULT_GRACE, MISSING_MARKER_REASON, Catalog
from zephon.catalog.claims import DEFAULT_LEASE, claim_holder
from zephon.catalog.engine import mask_url
from zephon.catalog.errors import (
    CatalogDatabaseError,
    CatalogError,
    CatalogUnavailableError,
    CheckpointExistsError,
    CheckpointRecordNotFoundError,
    FencedOutError,
    InvalidTransitionError,
    InvalidValueError,
    MigrationsNotFoundError,
    ReplicaNotFoundError,
    RunConflictError,
    RunExistsError,
    RunNotFoundError,
    SchemaDriftError,
    SchemaError,
    SchemaOutdatedError,
    SchemaUnversionedError,
    StateConflictError,
)
from zephon.catalog.models import CheckpointState, ReplicaState, ReplicaTier, RunKind, RunStatus
from zephon.catalog.records import (
    AttemptRecord,
    AttemptRegistration,
    CheckpointRecord,
    EventRecord,
    ReplicaRecord,
    RunRecord,
    RunSummary,
)
from zephon.catalog.repairs import SyncOutcome
from zephon.catalog.retention import Action, Decision, ResumePoint, RetentionPlan, plan_retention
from zephon.catalog.runs import UNSET
from zephon.catalog.validate import TIMING_PHASES


def upgrade(url: str) -> tuple[str | None, str]:
    """Migrate the catalog at ``url`` to the schema head (``zephon db upgrade``).

    Returns ``(revision before, revision after)``; an empty database is created.
    """
    with Catalog(url, check_schema=False) as catalog:
        return catalog.upgrade()


def current_revision(url: str) -> str | None:
    """The verified schema revision of the catalog at ``url`` (``zephon db current``).

    ``None`` for a database without a catalog yet; the revision when the tables are that
    revision's (at head also checked with Alembic's ``compare_metadata``). Raises the
    ``SchemaError`` that explains anything else: ``SchemaDriftError``,
    ``SchemaUnversionedError``, ``SchemaOutdatedError(known=False)``. A returned revision
    other than ``head_revision()`` is therefore one that ``upgrade`` migrates.
    """
    with Catalog(url, check_schema=False) as catalog:
        return catalog.current_revision()


def head_revision() -> str:
    """The schema revision this version of the code needs."""
    return Catalog.head_revision()


__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_LEASE",
    "MISSING_MARKER_REASON",
    "TIMING_PHASES",
    "UNSET",
    "Action",
    "AttemptRecord",
    "AttemptRegistration",
    "Catalog",
    "CatalogDatabaseError",
    "CatalogError",
    "CatalogUnavailableError",
    "CheckpointExistsError",
    "CheckpointRecordNotFoundError",
    "CheckpointRecord",
    "CheckpointState",
    "Decision",
    "EventRecord",
    "InvalidTransitionError",
    "InvalidValueError",
    "MigrationsNotFoundError",
    "ReplicaNotFoundError",
    "ReplicaRecord",
    "ReplicaState",
    "ReplicaTier",
    "ResumePoint",
    "RetentionPlan",
    "RunConflictError",
    "RunExistsError",
    "RunKind",
    "RunNotFoundError",
    "RunRecord",
    "RunStatus",
    "RunSummary",
    "SchemaDriftError",
    "SchemaError",
    "SchemaOutdatedError",
    "SchemaUnversionedError",
    "FencedOutError",
    "StateConflictError",
    "SyncOutcome",
    "claim_holder",
    "current_revision",
    "head_revision",
    "mask_url",
    "plan_retention",
    "upgrade",
]
