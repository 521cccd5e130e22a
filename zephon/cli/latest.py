"""``zephon latest RUN``: the catalog's answer without the ORM when it can give one alone.

``catalog.latest_alone`` reads the catalog in one statement (the stdlib ``sqlite3`` for a
SQLite file, SQLAlchemy Core for PostgreSQL) and answers where the full lookup
(``zephon.cli.commands.cmd_latest``, through ``Catalog`` and ``zephon.latest``) would answer
without reading storage, with the same answer. Everything else goes to the full lookup:
``--check``, ``--json`` and ``--save-dir`` (they read storage), and whatever ``latest_alone``
leaves to it (a schema not at head, an unknown run, a run whose attempt is deciding, a row to
probe, a SQLite error to explain). So the common case loads no SQLAlchemy on SQLite: this
module imports only the catalog's lookup and the plain line printer
(``tests/test_import_cost.py`` checks it).
"""

from __future__ import annotations

import argparse

from zephon.catalog import latest_alone
from zephon.cli import EXIT_NOT_FOUND, EXIT_OK, storage_options
from zephon.cli.render import say
from zephon.locations import resolve_catalog_url, retry_from_env

__all__ = ["cmd_latest"]


def cmd_latest(args: argparse.Namespace) -> int:
    """Print the URL of the run's latest complete checkpoint (exit 1: none); see the module
    docstring for which lookup answers."""
    if args.run and not (args.check or args.json or args.save_dir):
        # what the full lookup refuses before it reads the catalog, refused here too
        storage_options(args)
        answer = latest_alone(resolve_catalog_url(args.catalog), args.run)
        if answer is not None:
            retry_from_env()  # the full lookup reads it to open the run's store (deferred)
            if answer.path is None:
                say(f"no complete checkpoint for run {args.run}")
                return EXIT_NOT_FOUND
            say(answer.path)
            return EXIT_OK
    from zephon.cli import commands

    return commands.cmd_latest(args)
