"""the stall as a column: checkpoints.stall_s, and ix_checkpoints_attempt_saves

Revision ID: b42909832679
Revises: 5d41c0a7e9b2
Create Date: 2027-02-10

A run's goodput needs every save's stall, which sat only inside each row's JSON ``timings``:
the dashboard's aggregate over a page of runs (``Catalog.save_summaries``, 50,000 rows for
50 runs of 1,000 checkpoints) parsed 50,000 JSON documents on SQLite and read every row's
heap tuple on PostgreSQL, where the planner also hashed the whole table for the second pass.

- ``checkpoints.stall_s``: ``timings["stall_s"]`` as a column of its own (double precision,
  null: not timed, or no stall recorded). The catalog writes it in the same statement as
  ``timings`` from now on; this revision fills it for existing rows from their timings (a
  number there, or null), so no row's goodput changes. On PostgreSQL that rewrites every
  timed row in the upgrade's transaction, which holds writers to ``checkpoints`` back
  meanwhile (10-20 s per million timed rows on the benchmark machine).
- ``ix_checkpoints_attempt_saves (run_id, epoch, created_at, committed_at, step,
  stall_s)``: a run's rows per attempt in time order, with every column those reads take,
  so they are index-only, and "the rows of attempt E from time T on" is one range of it.

Downgrading drops the index and the column; ``timings`` still holds every stall.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b42909832679"
down_revision: str | Sequence[str] | None = "5d41c0a7e9b2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_checkpoints_attempt_saves"

# Only a JSON number is a stall (the catalog never wrote anything else there); anything
# else stays null, as the old reads counted it as no stall.
_BACKFILL = {
    "postgresql": (
        "UPDATE checkpoints SET stall_s = CAST(timings ->> 'stall_s' AS DOUBLE PRECISION) "
        "WHERE jsonb_typeof(timings -> 'stall_s') = 'number'"
    ),
    "sqlite": (
        "UPDATE checkpoints SET stall_s = json_extract(timings, '$.stall_s') "
        "WHERE json_type(timings, '$.stall_s') IN ('integer', 'real')"
    ),
}


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("stall_s", sa.Double(), nullable=True))
    op.execute(_BACKFILL[op.get_bind().dialect.name])
    op.create_index(
        op.f(_INDEX),
        "checkpoints",
        ["run_id", "epoch", "created_at", "committed_at", "step", "stall_s"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f(_INDEX), table_name="checkpoints")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("stall_s")
