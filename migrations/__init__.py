"""Alembic environment and revisions of the Zephon catalog schema, shipped inside the package.

Nothing here is imported by application code: ``catalog.schema`` points Alembic's
``script_location`` at this package's directory, wherever it is installed, and hands over an
open connection, so migrations never depend on the current working directory or an ini file.
``alembic.ini`` beside this file is for developers writing new revisions:

    alembic -c migrations/alembic.ini -x url=sqlite:///dev.db upgrade head
    alembic -c migrations/alembic.ini -x url=sqlite:///dev.db revision --autogenerate -m "..."
"""

from __future__ import annotations

import os

LOCATION = os.path.dirname(os.path.abspath(__file__))
"""The directory holding ``env.py``, ``script.py.mako`` and ``versions/``."""
