"""a checkpoint's own bytes: checkpoints.stored_bytes

Revision ID: e3a6f1c28d57
Revises: b42909832679
Create Date: 2027-02-24

A deduplicated save (docs/dedup.md) lists ``bytes`` of files but stores only the chunks its
base did not hold: ``checkpoints.stored_bytes`` records those (new chunks and plain files),
so ``zephon checkpoints`` shows a save's logical size beside what it added to storage. Null:
the save stored every byte it lists (every save before this revision, and every plain save
after it), so no existing row needs a value.

Downgrading drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e3a6f1c28d57"
down_revision: str | Sequence[str] | None = "b42909832679"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("stored_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("stored_bytes")
