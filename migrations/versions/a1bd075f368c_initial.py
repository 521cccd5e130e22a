"""initial: runs, checkpoints (state machine, lease columns) and the events audit log

Revision ID: a1bd075f368c
Revises:
Create Date: 2026-11-29

Types are spelled out (here and in ``migrations.columns``) rather than imported from
``catalog.models``: a revision freezes the schema as it was, while the models keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from zephon.migrations.columns import JSON_DOCUMENT, TIMESTAMP

revision: str = "a1bd075f368c"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("storage_url", sa.Text(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("total_steps", sa.BigInteger(), nullable=True),
        sa.Column("num_to_keep", sa.Integer(), nullable=True),
        sa.Column("keep_every_steps", sa.BigInteger(), nullable=True),
        sa.Column("config", JSON_DOCUMENT, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint("kind IN ('train', 'inference')", name=op.f("ck_runs_kind")),
        sa.CheckConstraint(
            "status IN ('active', 'finished', 'failed')", name=op.f("ck_runs_status")
        ),
        sa.CheckConstraint(
            "num_to_keep IS NULL OR num_to_keep >= 1", name=op.f("ck_runs_num_to_keep")
        ),
        sa.CheckConstraint(
            "keep_every_steps IS NULL OR keep_every_steps >= 1",
            name=op.f("ck_runs_keep_every_steps"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("name", name=op.f("uq_runs_name")),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("attempt_id", sa.String(length=64), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("file_count", sa.Integer(), nullable=True),
        sa.Column("manifest_checksum", sa.String(length=128), nullable=True),
        sa.Column("pinned", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("metadata", JSON_DOCUMENT, nullable=True),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.Column("claimed_by", sa.String(length=255), nullable=True),
        sa.Column("claimed_at", TIMESTAMP, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("committed_at", TIMESTAMP, nullable=True),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint(
            "state IN ('pending', 'committed', 'deleting', 'deleted', 'failed')",
            name=op.f("ck_checkpoints_state"),
        ),
        sa.CheckConstraint("step >= 0", name=op.f("ck_checkpoints_step")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("run_id", "step", name=op.f("uq_checkpoints_run_id_step")),
    )
    # Makes "newest committed checkpoint of run R" a single backward index scan.
    op.create_index("ix_checkpoints_run_id_state_step", "checkpoints", ["run_id", "state", "step"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", TIMESTAMP, nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("run_name", sa.String(length=128), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("detail", JSON_DOCUMENT, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index("ix_events_run_name_at", "events", ["run_name", "at"])


def downgrade() -> None:
    op.drop_index("ix_events_run_name_at", table_name="events")
    op.drop_table("events")
    op.drop_index("ix_checkpoints_run_id_state_step", table_name="checkpoints")
    op.drop_table("checkpoints")
    op.drop_table("runs")
