"""memory replicas: ``checkpoint_replicas.tier`` may be ``memory``; a run's copies by tier

Revision ID: 5d41c0a7e9b2
Revises: c7d2e5a94b10
Create Date: 2027-02-01

The memory tier (docs/tiers.md, "The memory tier") records a copy of a checkpoint held in a
node's host memory as a replica row of tier ``memory``, one per node, beside the ``local`` and
``save_dir`` rows: the check constraint on ``tier`` widens; existing rows are untouched. SQLite
cannot alter a constraint in place: the batch mode copies the table (its rows are few: a
handful per checkpoint).

``ix_checkpoint_replicas_run_id_tier_state`` finds a run's live copies on one tier (the memory
tier's nodes) without reading the rows of every step the run ever had, which stay as
``deleted``; it also tells this revision's tables from the previous one's (the catalog's
fingerprint of a schema is its columns and indexes).
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


_INDEX = "ix_checkpoint_replicas_run_id_tier_state"


def upgrade() -> None:
    _allow("tier IN ('memory', 'local', 'save_dir')")
    op.create_index(op.f(_INDEX), "checkpoint_replicas", ["run_id", "tier", "state"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f(_INDEX), table_name="checkpoint_replicas")
    op.execute("DELETE FROM checkpoint_replicas WHERE tier = 'memory'")
    _allow("tier IN ('local', 'save_dir')")
