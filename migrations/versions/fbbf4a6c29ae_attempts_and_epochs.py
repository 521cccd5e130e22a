"""attempts and epochs: fencing tokens per run, save_id, corrupt and stale checkpoints

Revision ID: fbbf4a6c29ae
Revises: a1bd075f368c
Create Date: 2026-12-01

- ``checkpoints.attempt_id`` is renamed ``save_id`` (the token of one save); "attempt" now
  means one start of a job for a run.
- ``runs.epoch`` (the current attempt's fencing token) and ``checkpoints.epoch`` (the attempt
  that armed the row); 0 means "unfenced", which is what every existing row becomes.
- The ``attempts`` table: one row per registered attempt, unique per (run, epoch).
- Checkpoint states ``corrupt`` and ``stale``.

SQLite: ``checkpoints`` is recreated by batch mode (nothing references it, so dropping the old
copy is safe with ``foreign_keys=ON``). ``runs`` is referenced by ``checkpoints``, and
``PRAGMA foreign_keys`` cannot be switched off inside the migration transaction, so ``runs`` is
only ever changed with plain ``ALTER TABLE ... ADD/DROP COLUMN`` (a string server default keeps
Alembic from recreating it).

Types are spelled out (here and in ``migrations.columns``) rather than imported from
``catalog.models``: a revision freezes the schema as it was, while the models keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from zephon.migrations.columns import TIMESTAMP

revision: str = "fbbf4a6c29ae"
down_revision: str | Sequence[str] | None = "a1bd075f368c"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATES = "state IN ('pending', 'committed', 'deleting', 'deleted', 'failed')"
NEW_STATES = (
    "state IN ('pending', 'committed', 'deleting', 'deleted', 'failed', 'corrupt', 'stale')"
)


def upgrade() -> None:
    op.add_column("runs", sa.Column("epoch", sa.BigInteger(), server_default="0", nullable=False))
    with op.batch_alter_table("checkpoints") as batch:
        batch.alter_column(
            "attempt_id",
            new_column_name="save_id",
            existing_type=sa.String(length=64),
            existing_nullable=False,
        )
        batch.add_column(sa.Column("epoch", sa.BigInteger(), server_default="0", nullable=False))
        batch.drop_constraint(op.f("ck_checkpoints_state"), type_="check")
        batch.create_check_constraint(op.f("ck_checkpoints_state"), NEW_STATES)
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("attempt_id", sa.String(length=64), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("resumed_from", sa.BigInteger(), nullable=True),
        sa.Column("registered_at", TIMESTAMP, nullable=False),
        sa.Column("decided_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint("epoch >= 1", name=op.f("ck_attempts_epoch")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_attempts_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("run_id", "epoch", name=op.f("uq_attempts_run_id_epoch")),
    )


def downgrade() -> None:
    op.drop_table("attempts")
    # The old schema has no corrupt or stale state; both mean "not a usable checkpoint",
    # which the old code calls failed.
    op.execute("UPDATE checkpoints SET state = 'failed' WHERE state IN ('corrupt', 'stale')")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_constraint(op.f("ck_checkpoints_state"), type_="check")
        batch.create_check_constraint(op.f("ck_checkpoints_state"), OLD_STATES)
        batch.drop_column("epoch")
        batch.alter_column(
            "save_id",
            new_column_name="attempt_id",
            existing_type=sa.String(length=64),
            existing_nullable=False,
        )
    op.drop_column("runs", "epoch")
