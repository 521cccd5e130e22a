"""``Catalog``: the one object callers use. Validates arguments, runs each call in its own
transaction, records an audit event for every change, and returns frozen records.

Its methods live in role views, one module per role under ``catalog/roles/`` (runs, attempts,
the save path, checkpoint queries, pins, sync repairs, retention and deletion, events,
replicas), mixins that ``Catalog`` composes; every one opens its transaction through
``catalog.session_base.CatalogBase``. This module keeps connecting, the schema and closing.

Concurrency: every method is one short transaction, so one ``Catalog`` may be shared by the
threads of a process, and any number of processes (jobs, ``zephon gc``, ``zephon sync``) may
use the same database at once; the guarantees are those of the guarded transitions
(``catalog.transitions``) and of the claim protocol (``catalog.claims``). A ``Catalog`` must
not cross a ``fork()``: each process opens its own.

Fencing: a job registers each of its starts with ``register_attempt`` and passes that
attempt's ``epoch`` to the fenced calls (``begin_checkpoint``, ``mark_committed``, and
``update_run``/``claim_for_deletion`` when given an epoch), which are refused with
``FencedOutError`` unless it is the run's current epoch, checked in the transaction that
makes the change (``catalog.attempts``).

Errors: argument problems raise ``InvalidValueError`` before any database work; database
problems raise ``CatalogUnavailableError``/``CatalogDatabaseError``; everything else is one of
the specific ``CatalogError`` subclasses documented per method. Messages mask the password.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

from sqlalchemy.engine import URL

from zephon.catalog import schema, validate
from zephon.catalog.engine import Database
from zephon.catalog.retention import DEFAULT_GRACE
from zephon.catalog.roles.attempts import AttemptMethods
from zephon.catalog.roles.checkpoints import CheckpointQueryMethods
from zephon.catalog.roles.deletion import DeletionMethods
from zephon.catalog.roles.events import PRUNE_BATCH, EventMethods
from zephon.catalog.roles.overview import OverviewMethods
from zephon.catalog.roles.pins import PinMethods
from zephon.catalog.roles.replicas import ReplicaMethods
from zephon.catalog.roles.runs import RunMethods
from zephon.catalog.roles.saving import SaveMethods
from zephon.catalog.roles.sync import MISSING_MARKER_REASON, SyncMethods

__all__ = ["DEFAULT_GRACE", "MISSING_MARKER_REASON", "PRUNE_BATCH", "Catalog"]


class Catalog(
    RunMethods,
    AttemptMethods,
    SaveMethods,
    CheckpointQueryMethods,
    PinMethods,
    SyncMethods,
    DeletionMethods,
    EventMethods,
    ReplicaMethods,
    OverviewMethods,
):
    """The catalog of runs and checkpoints in one SQLite or PostgreSQL database.

    Its methods are those of the role views it is composed of (``catalog/roles/``), each
    described there; this class connects, checks the schema and closes.

    ``Catalog(url)`` connects, creates an empty database at the schema head, and refuses a
    database it cannot use with the ``SchemaError`` that says why (``catalog.schema``): a
    revision behind (``SchemaOutdatedError`` naming ``zephon db upgrade``) or unknown, tables
    that differ from the recorded revision (``SchemaDriftError``), tables without a recorded
    revision (``SchemaUnversionedError``). The check costs two small queries.
    ``check_schema=False`` skips it, for ``upgrade()`` and ``current_revision()`` (the
    ``zephon db`` commands), which make their own. ``actor`` overrides the
    ``user@host:pid`` recorded in events.

    ``read_only=True`` opens the database so that it refuses every write (SQLite
    ``mode=ro``, PostgreSQL read-only transactions), for viewers such as ``zephon ui``: the
    schema is checked, never created or migrated (an empty database is a ``SchemaError``),
    and a writing method fails with ``CatalogUnavailableError``/``CatalogDatabaseError``.
    """

    def __init__(
        self,
        url: str | URL,
        *,
        actor: str | None = None,
        check_schema: bool = True,
        read_only: bool = False,
    ) -> None:
        if actor is not None:
            # The claim token is "<actor>/<12 hex>" in a 255-character column.
            validate.text("actor", actor, maximum=242)
        self._db = Database(url, read_only=read_only)
        self._actor = actor
        if check_schema:
            try:
                if read_only:
                    schema.check_schema(self._db)
                else:
                    schema.ensure_schema(self._db)
            except BaseException:
                self._db.dispose()
                raise

    def close(self) -> None:
        """Release the connection pool. Idempotent."""
        self._db.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Catalog({self.url!r})"

    def upgrade(self) -> tuple[str | None, str]:
        """Migrate the schema to head (``zephon db upgrade``); ``(before, after)`` revisions."""
        return schema.upgrade_schema(self._db)

    def current_revision(self) -> str | None:
        """The verified schema revision (``zephon db current``): None if no catalog was
        created yet; raises the ``SchemaError`` explaining a schema this code cannot use."""
        return schema.current_revision(self._db)

    @staticmethod
    def head_revision() -> str:
        """The schema revision this code needs."""
        return schema.head_revision()
