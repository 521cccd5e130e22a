"""Zephon's SQL catalog of runs and checkpoints (SQLite embedded, PostgreSQL in production).

The catalog is an index: storage holds the bytes and the commit markers, the catalog answers
"latest complete checkpoint of run R" with one indexed query, keeps the retention policy, and
coordinates deletions between jobs and gc processes. It never imports fsspec, torch,
``storage`` or ``zephon``; the ``zephon`` package composes it with storage.

Start with ``Catalog`` (docs/catalog.md describes the tables, states and protocols).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it. Resolved on first use, so that ``import
# zephon.catalog`` and its errors and states load no SQLAlchemy (and never Alembic, which only
# creating and upgrading a schema needs): a command that fails before it opens the catalog, or
# never opens it, does not pay for them.
_LAZY = {
    "Catalog": "zephon.catalog.catalog",
    "DEFAULT_GRACE": "zephon.catalog.retention",
    "MISSING_MARKER_REASON": "zephon.catalog.roles.sync",
    "DEFAULT_LEASE": "zephon.catalog.claims",
    "claim_holder": "zephon.catalog.claims",
    "mask_url": "zephon.catalog.engine",
    **{
        name: "zephon.catalog.errors"
        for name in (
            "CatalogDatabaseError",
            "CatalogError",
            "CatalogUnavailableError",
            "CheckpointExistsError",
            "CheckpointRecordNotFoundError",
            "FencedOutError",
            "InvalidTransitionError",
            "InvalidValueError",
            "MigrationsNotFoundError",
            "ReplicaNotFoundError",
            "RunConflictError",
            "RunExistsError",
            "RunNotFoundError",
            "SchemaDriftError",
            "SchemaError",
            "SchemaOutdatedError",
            "SchemaUnversionedError",
            "StateConflictError",
        )
    },
    **{
        name: "zephon.catalog.states"
        for name in ("CheckpointState", "ReplicaState", "ReplicaTier", "RunKind", "RunStatus")
    },
    **{
        name: "zephon.catalog.records"
        for name in (
            "AttemptRecord",
            "AttemptRegistration",
            "CheckpointRecord",
            "EventRecord",
            "ReplicaRecord",
            "RunRecord",
            "RunSummary",
        )
    },
    "SyncOutcome": "zephon.catalog.repairs",
    **{
        name: "zephon.catalog.retention"
        for name in ("Action", "Decision", "ResumePoint", "RetentionPlan", "plan_retention")
    },
    "UNSET": "zephon.catalog.runs",
    **{
        name: "zephon.catalog.roles.overview"
        for name in ("AttemptSaves", "CopyRow", "RunPage", "SaveRow", "TimelineRow")
    },
    **{
        name: "zephon.catalog.lookup" for name in ("PROBED_STATES", "CatalogLatest", "latest_alone")
    },
    "TIMING_PHASES": "zephon.catalog.validate",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon.catalog' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def upgrade(url: str) -> tuple[str | None, str]:
    """Migrate the catalog at ``url`` to the schema head (``zephon db upgrade``).

    Returns ``(revision before, revision after)``; an empty database is created.
    """
    from zephon.catalog.catalog import Catalog

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
    from zephon.catalog.catalog import Catalog

    with Catalog(url, check_schema=False) as catalog:
        return catalog.current_revision()


def head_revision() -> str:
    """The schema revision this version of the code needs."""
    from zephon.catalog.schema import head_revision

    return head_revision()


__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_LEASE",
    "MISSING_MARKER_REASON",
    "PROBED_STATES",
    "TIMING_PHASES",
    "UNSET",
    "Action",
    "AttemptRecord",
    "AttemptSaves",
    "AttemptRegistration",
    "Catalog",
    "CatalogDatabaseError",
    "CatalogError",
    "CatalogLatest",
    "CatalogUnavailableError",
    "CheckpointExistsError",
    "CheckpointRecordNotFoundError",
    "CheckpointRecord",
    "CheckpointState",
    "CopyRow",
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
    "RunPage",
    "RunRecord",
    "RunStatus",
    "RunSummary",
    "SchemaDriftError",
    "SchemaError",
    "SchemaOutdatedError",
    "SchemaUnversionedError",
    "SaveRow",
    "FencedOutError",
    "StateConflictError",
    "SyncOutcome",
    "TimelineRow",
    "claim_holder",
    "current_revision",
    "head_revision",
    "latest_alone",
    "mask_url",
    "plan_retention",
    "upgrade",
]
