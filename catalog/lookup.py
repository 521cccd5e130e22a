"""The latest checkpoint of a run as the catalog alone can give it, in one statement and
without the ORM: what ``zephon latest RUN`` answers from a fresh process.

``latest_alone(url, run)`` gives the answer only where the full lookup (``zephon.latest``,
through ``Catalog``) would give it without reading storage, and the same answer; it returns
None, "ask the full lookup", wherever that one needs more:

- the stored schema revision is not ``HEAD_REVISION`` (or there is no catalog yet): the full
  lookup opens ``Catalog(url)``, which creates, or refuses with the one-line error that says
  why;
- the run is unknown (the full lookup words that, with the masked URL);
- the run has no current attempt whose resume point is decided (epoch 0, or a job deciding
  now): its lineage must be read from storage;
- a row above the newest committed one is in one of ``PROBED_STATES``: its marker must be
  probed (a save that died between its marker and the catalog update is promoted);
- on SQLite, any error (a missing file, a lock, a URL form this module does not read): the full
  lookup says what is wrong.

Otherwise the answer is the newest committed row (``CatalogLatest``), or ``CatalogLatest(None)``
for a run without one. tests/catalog/test_lookup.py runs both lookups on the same catalogs and
fails when a rule diverges.

Why two drivers: importing SQLAlchemy's Core alone costs more than the command's whole budget
(0.25 s; the ORM and the models double that), while the stdlib ``sqlite3`` costs nothing. So a
SQLite file is read through ``sqlite3``, and PostgreSQL through SQLAlchemy Core (``psycopg``
is needed anyway), never the ORM or ``catalog.models``. Both run the same SQL text, one
snapshot: the revision and the answer are read in one transaction.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from dataclasses import dataclass

from zephon.catalog.revision import HEAD_REVISION, VERSION_TABLE
from zephon.catalog.states import CheckpointState

__all__ = ["PROBED_STATES", "SQLITE_BUSY_TIMEOUT_S", "CatalogLatest", "latest_alone"]

#: states of rows above the newest committed one whose marker a lookup must probe: a save that
#: wrote its marker and died before the catalog heard (pending), one marked failed or deleted
#: although its marker is complete
PROBED_STATES = (CheckpointState.PENDING, CheckpointState.FAILED, CheckpointState.DELETED)

#: how long a SQLite connection waits for a lock, here and in ``catalog.engine``'s engines
SQLITE_BUSY_TIMEOUT_S = 30

_REVISION = f"SELECT version_num FROM {VERSION_TABLE}"

# One row for a known run: its epoch's attempt (decided or not), its newest committed row, and
# whether a row in PROBED_STATES lies above it. The newest committed row is found as
# ``queries.latest_committed`` finds it: a backward scan of (run_id, state, step) that stops at
# the first entry. Steps are >= 0 (a check constraint), so -1 stands for "no committed row".
_LATEST = f"""
SELECT
    a.id IS NOT NULL AND a.decided_at IS NOT NULL AS decided,
    c.step, c.path, c.save_id,
    EXISTS (
        SELECT 1 FROM checkpoints AS p
        WHERE p.run_id = r.id
          AND p.state IN ({", ".join(f"'{state.value}'" for state in PROBED_STATES)})
          AND p.step > COALESCE(c.step, -1)
    ) AS above
FROM runs AS r
LEFT JOIN attempts AS a ON a.run_id = r.id AND a.epoch = r.epoch
LEFT JOIN checkpoints AS c ON c.id = (
    SELECT n.id FROM checkpoints AS n
    WHERE n.run_id = r.id AND n.state = '{CheckpointState.COMMITTED.value}'
    ORDER BY n.step DESC LIMIT 1
)
WHERE r.name = :run
"""


@dataclass(frozen=True, slots=True)
class CatalogLatest:
    """The catalog's latest complete checkpoint of a run: its step, URL (the row's ``path``)
    and save, or all None when the run has none."""

    step: int | None
    path: str | None = None
    save_id: str | None = None


def latest_alone(url: str, run: str) -> CatalogLatest | None:
    """The run's latest checkpoint from the catalog at ``url`` alone, or None when the full
    lookup must answer (see the module docstring). Reads only; the run name is the caller's
    validated one. On PostgreSQL an unreachable server raises ``CatalogUnavailableError``
    (the full lookup would only meet it again, after a second connect timeout)."""
    path = _sqlite_file(url)
    if path is not None:
        return _from_sqlite(path, run)
    if url.startswith(("sqlite:", "sqlite+")):
        return None  # a SQLite URL form left to SQLAlchemy: the full lookup reads it
    return _from_core(url, run)


def _answer(revisions: list[tuple], rows: list[tuple]) -> CatalogLatest | None:
    if [tuple(row) for row in revisions] != [(HEAD_REVISION,)] or len(rows) != 1:
        return None
    decided, step, path, save_id, above = rows[0]
    if not decided or above:
        return None
    return CatalogLatest(step, path, save_id)


def _sqlite_file(url: str) -> str | None:
    """The file a plain ``sqlite:///PATH`` URL names (as SQLAlchemy reads it); None for any
    other form (a query string, ``file:`` URIs, memory), which the full lookup handles."""
    for prefix in ("sqlite:///", "sqlite+pysqlite:///"):
        if url.startswith(prefix):
            path = urllib.parse.unquote(url[len(prefix) :])
            if "?" in url or not path or path == ":memory:" or path.startswith("file:"):
                return None
            return path
    return None


def _from_sqlite(path: str, run: str) -> CatalogLatest | None:
    # mode=rw: never create a missing file (the full lookup creates the catalog, or says why
    # it cannot); the catalog's engines set WAL on the file, which readers need not repeat.
    uri = f"file:{urllib.parse.quote(path)}?mode=rw"
    try:
        connection = sqlite3.connect(
            uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S, isolation_level=None
        )
    except sqlite3.Error:
        return None
    try:
        connection.execute("BEGIN")  # one snapshot for the revision and the answer
        revisions = connection.execute(_REVISION).fetchall()
        rows = connection.execute(_LATEST, {"run": run}).fetchall()
        connection.execute("COMMIT")
    except sqlite3.Error:
        return None
    finally:
        connection.close()
    return _answer(revisions, rows)


def _from_core(url: str, run: str) -> CatalogLatest | None:
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    from zephon.catalog.engine import make_engine, mask_url, translate_errors, url_secrets

    engine = make_engine(url)
    try:
        # only a connection failure is said here, as the full lookup would say it; any other
        # error (no catalog tables yet, a permission) is left to the full lookup to explain
        action = f"find the latest checkpoint of run {run!r}"
        with translate_errors(mask_url(engine.url), action, url_secrets(engine.url)):
            try:
                with engine.connect() as connection, connection.begin():
                    revisions = connection.execute(text(_REVISION)).all()
                    rows = connection.execute(text(_LATEST), {"run": run}).all()
            except (OperationalError, InterfaceError):
                raise
            except DBAPIError:
                return None
    finally:
        engine.dispose()
    return _answer(revisions, rows)
