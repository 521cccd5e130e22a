"""Alembic environment of the catalog schema.

Two callers:

- ``catalog.schema`` (what ``Catalog(url)`` and ``zephon db upgrade`` use) passes an open
  connection in ``config.attributes["connection"]``, already inside the transaction that holds
  the schema lock; the migrations run in that transaction and the caller commits.
- A developer running the ``alembic`` command with ``migrations/alembic.ini`` and
  ``-x url=...``; then this file builds the engine itself.

Logging is deliberately not configured here: Zephon runs migrations inside user programs, whose
logging setup must not be replaced by Alembic's ini-file defaults.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from zephon.catalog.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    context.configure(
        connection=connection,
        url=url,
        target_metadata=target_metadata,
        # Future revisions that alter tables must work on SQLite, which can only recreate them.
        render_as_batch=True,
        compare_type=True,
    )


def _url_from_command_line() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise SystemExit("pass the catalog database: alembic -x url=sqlite:///PATH ...")
    return url


def run_offline() -> None:
    _configure(url=_url_from_command_line())
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return

    from zephon.catalog.engine import make_engine

    engine = make_engine(_url_from_command_line())
    try:
        with engine.connect() as own_connection:
            _configure(connection=own_connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
