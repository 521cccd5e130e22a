"""events retention: an index on events.at

Revision ID: 3a0e83d9015e
Revises: fbbf4a6c29ae
Create Date: 2027-01-10

``Catalog.prune_events`` deletes the events older than a cut-off in bounded batches; each
batch is a range scan of ``ix_events_at``, so pruning costs what it deletes rather than a scan
of the whole log per batch.

The index is built in the upgrade's transaction, which on PostgreSQL holds a lock on
``events`` that makes writers wait until it is built (about a second per million events on
the benchmark machine). ``IF NOT EXISTS``: an operator may have created it by hand already,
under this name, to speed up a manual clean-up.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "3a0e83d9015e"
down_revision: str | Sequence[str] | None = "fbbf4a6c29ae"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(op.f("ix_events_at"), "events", ["at"], unique=False, if_not_exists=True)


def downgrade() -> None:
    op.drop_index(op.f("ix_events_at"), table_name="events", if_exists=True)
