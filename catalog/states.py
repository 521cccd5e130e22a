"""The states and kinds of catalog rows, as plain enums: what callers compare a record's
``state`` or ``kind`` with, and what the CLI offers as choices, without loading SQLAlchemy
(``catalog.models`` builds its check constraints from them)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["CheckpointState", "ReplicaState", "ReplicaTier", "RunKind", "RunStatus"]


class CheckpointState(StrEnum):
    """States of a checkpoint row; transitions are in ``docs/catalog.md``.

    ``CORRUPT``: verification of the stored checkpoint failed. Never latest, never counted by
    retention, kept for inspection until gc deletes it with ``corrupt=True``.
    ``STALE``: the row belongs to a history that a newer attempt abandoned (a step above the
    point that attempt resumed from). Never latest; gc deletes it once the grace has passed.
    """

    PENDING = "pending"
    COMMITTED = "committed"
    DELETING = "deleting"
    DELETED = "deleted"
    FAILED = "failed"
    CORRUPT = "corrupt"
    STALE = "stale"


class ReplicaState(StrEnum):
    """States of a replica row (one copy of a checkpoint on one tier): ``pending`` while it is
    written or uploaded, then ``committed`` or ``failed``; ``committed -> deleted`` when it is
    removed; ``pending``, ``failed`` and ``deleted`` rows, and committed rows of an older
    save, are re-armed ``pending`` by a new save of the step."""

    PENDING = "pending"
    COMMITTED = "committed"
    FAILED = "failed"
    DELETED = "deleted"


class ReplicaTier(StrEnum):
    """Where a replica lives: ``memory`` (a node's host memory, one row per node), ``local``
    (a node-local disk, one row per host) or ``save_dir`` (the job's shared storage, host
    ``""``)."""

    MEMORY = "memory"
    LOCAL = "local"
    SAVE_DIR = "save_dir"


class RunKind(StrEnum):
    TRAIN = "train"
    INFERENCE = "inference"


class RunStatus(StrEnum):
    ACTIVE = "active"
    FINISHED = "finished"
    FAILED = "failed"
