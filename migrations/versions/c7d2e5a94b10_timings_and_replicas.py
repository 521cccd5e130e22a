"""timings and replicas: checkpoints.timings, the checkpoint_replicas table

Revision ID: c7d2e5a94b10
Revises: 3a0e83d9015e
Create Date: 2027-01-20

- ``checkpoints.timings``: a JSON document, phase name -> seconds of the save that committed
  the row (``stall_s``, ``write_s``, ``commit_s``, ``total_s``...); NULL for every existing
  row (they were not timed).
- ``checkpoint_replicas``: one row per copy of a checkpoint on a storage tier, unique per
  (run, step, tier, host): a node-local disk (``local``, one per host) and the job's
  ``save_dir`` (host ``""``), each ``pending -> committed | failed``, ``committed ->
  deleted``. Its rows go with their run (``ON DELETE CASCADE``).

Both are additions: ``checkpoints.timings`` is a plain ``ADD COLUMN`` (nullable, no default,
so SQLite does not recreate the table) and every existing row is kept as it is. Downgrading
drops the table and the column; the timings and replica rows are lost, nothing else.

Types are spelled out (here and in ``migrations.columns``) rather than imported from
``catalog.models``: a revision freezes the schema as it was, while the models keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from zephon.migrations.columns import JSON_DOCUMENT, TIMESTAMP

revision: str = "c7d2e5a94b10"
down_revision: str | Sequence[str] | None = "3a0e83d9015e"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("timings", JSON_DOCUMENT, nullable=True))
    op.create_table(
        "checkpoint_replicas",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("save_id", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("timings", JSON_DOCUMENT, nullable=True),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("committed_at", TIMESTAMP, nullable=True),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint(
            "state IN ('pending', 'committed', 'failed', 'deleted')",
            name=op.f("ck_checkpoint_replicas_state"),
        ),
        sa.CheckConstraint(
            "tier IN ('local', 'save_dir')", name=op.f("ck_checkpoint_replicas_tier")
        ),
        sa.CheckConstraint("step >= 0", name=op.f("ck_checkpoint_replicas_step")),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_checkpoint_replicas_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_replicas")),
        sa.UniqueConstraint(
            "run_id",
            "step",
            "tier",
            "host",
            name=op.f("uq_checkpoint_replicas_run_id_step_tier_host"),
        ),
    )


def downgrade() -> None:
    op.drop_table("checkpoint_replicas")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("timings")
