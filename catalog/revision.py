"""Which schema this code needs, as plain constants: importing them loads no SQLAlchemy or
Alembic, so a read that checks the revision (``catalog.lookup``) stays as cheap as its query.
``catalog.schema`` and ``catalog.drift`` use them too."""

from __future__ import annotations

__all__ = ["HEAD_REVISION", "VERSION_TABLE"]

#: The newest revision in ``migrations/versions``: the schema this code's models describe. Kept
#: as a constant so that opening a catalog compares the stored revision with it without
#: importing Alembic; a new migration moves it (``tests/test_import_cost.py`` checks it against
#: the scripts).
HEAD_REVISION = "e3a6f1c28d57"

#: Alembic's table holding the revision a database is at (one row)
VERSION_TABLE = "alembic_version"
