"""Column types the revisions in ``versions/`` share, defined once.

A revision freezes the schema as it was, so these are spelled out here rather than imported
from ``catalog.models`` (the models keep changing). They are frozen too: a revision must
create the same tables forever, so a type here is never edited; a revision that needs a
different one defines a new name.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

TIMESTAMP = sa.DateTime(timezone=True)
"""Every catalog timestamp: timezone-aware (``TIMESTAMP WITH TIME ZONE`` on PostgreSQL)."""

JSON_DOCUMENT = sa.JSON(none_as_null=True).with_variant(
    postgresql.JSONB(none_as_null=True), "postgresql"
)
"""A JSON document column: JSONB on PostgreSQL, JSON text elsewhere; Python None is NULL."""
