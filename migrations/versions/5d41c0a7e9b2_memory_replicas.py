"""memory replicas: ``checkpoint_replicas.tier`` may be ``memory``

Revision ID: 5d41c0a7e9b2
Revises: c7d2e5a94b10
Create Date: 2027-02-01

The memory tier (docs/tiers.md, "The memory tier") records a copy of a checkpoint held in a
node's host memory as a replica row of tier ``memory``, one per node, beside the ``local`` and
``save_dir`` rows. Only the check constraint on ``tier`` changes; existing rows are untouched.
SQLite cannot alter a constraint in place: the batch mode copies the table (its rows are few:
a handful per checkpoint kept).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "5d41c0a7e9b2"
down_revision: str | Sequence[str] | None = "c7d2e5a94b10"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NAME = "ck_checkpoint_replicas_tier"


def _allow(condition: str) -> None:
    with op.batch_alter_table("checkpoint_replicas") as batch:
        batch.drop_constraint(op.f(_NAME), type_="check")
        batch.create_check_constraint(op.f(_NAME), condition)


def upgrade() -> None:
    _allow("tier IN ('memory', 'local', 'save_dir')")


def downgrade() -> None:
    op.execute("DELETE FROM checkpoint_replicas WHERE tier = 'memory'")
    _allow("tier IN ('local', 'save_dir')")
