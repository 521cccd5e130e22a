"""The catalog layer's exceptions: one root, and specific subclasses that carry their data.

Every message names the object (database URL with the password masked, run, step) and the fix,
so the ``zephon`` CLI can print ``str(exc)`` as its one-line error. Callers that need to branch
read the attributes, never the message text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # records import models; errors stay importable on their own
    from zephon.catalog.records import AttemptRecord


class CatalogError(Exception):
    """Root of every error the catalog layer raises on purpose.

    Picklable whatever the subclass's constructor takes (a distributed job sends the error one
    rank met to the others): rebuilt from its message and attributes, not by calling
    ``__init__`` again.

    ``CatalogError(message, **fields)`` also sets each field as an attribute: subclasses
    build their one-line message from their fields and hand both over."""

    def __init__(self, *args: object, **fields: Any) -> None:
        super().__init__(*args)
        self.__dict__.update(fields)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle_error, (type(self), self.args, dict(self.__dict__)))


def _unpickle_error(cls: type[CatalogError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class InvalidValueError(CatalogError, ValueError):
    """An argument is out of range (run name, step, retention value, URL with a password).

    Raised before the database is touched; the message names the argument, the value and what
    is allowed.
    """

    def __init__(self, argument: str, value: object, allowed: str) -> None:
        super().__init__(
            f"invalid {argument} {_shown(value)}: {allowed}",
            argument=argument,
            value=value,
            allowed=allowed,
        )


_SHOWN = 120


def _shown(value: object) -> str:
    """``repr(value)``, shortened: a hostile megabyte-long name still gives a one-line error."""
    try:
        text = repr(value)
    except Exception:  # a value whose __repr__ fails must not hide the real error
        text = f"<{type(value).__name__}>"
    if len(text) <= _SHOWN:
        return text
    size = f"{len(value):,} characters" if isinstance(value, str) else f"{len(text):,} in repr"
    return f"{text[:_SHOWN]}... ({size})"


class CatalogUnavailableError(CatalogError):
    """The catalog database cannot be reached or answered with a connection-level failure."""

    DEFAULT_FIX = (
        "check that the database server is running and the URL (--catalog or "
        "ZEPHON_CATALOG_URL) is right"
    )

    def __init__(self, url: str, reason: str, fix: str | None = None) -> None:
        super().__init__(
            f"catalog {url} is unavailable: {reason}; {fix or self.DEFAULT_FIX}",
            url=url,
            reason=reason,
        )


class CatalogDatabaseError(CatalogError):
    """The database rejected a statement for a reason other than connectivity.

    Seeing this means a bug or a schema edited by hand; the message keeps the driver's reason.
    """

    def __init__(self, url: str, action: str, reason: str) -> None:
        super().__init__(
            f"catalog {url} failed to {action}: {reason}; check the schema with "
            f"`zephon db current --catalog {url}` and report this if it persists",
            url=url,
            action=action,
            reason=reason,
        )


class SchemaError(CatalogError):
    """The database's schema is not one this code can work with."""

    def __init__(self, url: str, message: str, **fields: Any) -> None:
        super().__init__(message, url=url, **fields)


class SchemaOutdatedError(SchemaError):
    """The schema revision differs from the code's head: behind it, or unknown to this code.

    ``current`` is the revision found (``None``: an ``alembic_version`` table without a row),
    ``head`` the revision this code needs, ``known`` whether this code's migrations contain
    ``current`` (``False`` usually means a newer Zephon wrote the database).
    """

    def __init__(self, url: str, current: str | None, head: str, *, known: bool) -> None:
        upgrade = f"`zephon db upgrade --catalog {url}`"
        if known:
            found = "no revision" if current is None else f"revision {current}"
            message = (
                f"catalog {url} has schema {found}, behind this Zephon's {head}; "
                f"run {upgrade} (back the database up first)"
            )
        else:
            message = (
                f"catalog {url} has schema revision {current}, which this Zephon (head {head}) "
                f"does not know: it was probably written by a newer Zephon; upgrade the zephon "
                f"package, then run {upgrade} if the database is still behind"
            )
        super().__init__(url, message, current=current, head=head, known=known)


class SchemaUnversionedError(SchemaError):
    """Catalog tables exist but no revision is recorded: no ``alembic_version`` table, or one
    without a row.

    ``tables`` are the catalog tables found, ``version_table`` whether ``alembic_version``
    exists. ``matches`` is the revision whose tables and columns they equal exactly (None if
    none does); then ``fix_sql`` holds the statements that record it. Otherwise ``closest`` is
    the nearest revision and ``differences`` what differs from it.
    """

    def __init__(
        self,
        url: str,
        tables: list[str],
        *,
        version_table: bool = False,
        head: str | None = None,
        matches: str | None = None,
        closest: str | None = None,
        differences: Sequence[str] = (),
    ) -> None:
        self.tables = tables
        self.version_table = version_table
        self.head = head
        self.matches = matches
        self.closest = closest
        self.differences = tuple(differences)
        self.fix_sql = stamp_sql(matches, create_table=not version_table) if matches else ()
        if version_table:
            where = "its alembic_version table has no row"
        else:
            where = "no alembic_version table"
        message = (
            f"catalog {url} has tables {', '.join(tables)} but {where}, so its schema revision "
            f"is not recorded; "
        )
        if matches is not None:
            message += f"they match revision {matches} exactly: record it with the SQL "
            message += f"`{'; '.join(self.fix_sql)}`"
            if head is not None and matches != head:
                message += f", then run `zephon db upgrade --catalog {url}`"
        else:
            if closest is not None:
                message += f"they match no revision of this Zephon (closest {closest}: "
                message += f"{', '.join(self.differences)}); "
            message += _rebuild(url)
        super().__init__(url, message)


def stamp_sql(revision: str, *, create_table: bool = False) -> tuple[str, ...]:
    """SQL recording ``revision`` as the schema revision (valid on SQLite and PostgreSQL)."""
    insert = f"INSERT INTO alembic_version (version_num) VALUES ('{revision}')"
    if not create_table:
        return (insert,)
    create = (
        "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
        "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
    )
    return (create, insert)


def _rebuild(url: str) -> str:
    return (
        f"zephon db upgrade cannot repair this: restore the database from a backup, or point "
        f"--catalog at a new, empty database (created at first use) and re-index the "
        f"checkpoints with `zephon sync <storage URL>` (the old {url} can then be dropped)"
    )


class SchemaDriftError(SchemaError):
    """The tables differ from the revision the database records: a column or table dropped by
    hand, a lost index, a column added by hand.

    ``revision`` is the recorded revision, ``head`` this code's, ``differences`` one line per
    difference (``missing column checkpoints.bytes``). ``fix_sql`` holds statements that
    repair it when that is possible without lost data (recreating an index, dropping an
    unexpected column), or, when the tables equal another revision exactly (``matches``), the
    statement that records that one; it is empty when only a backup can help.
    """

    def __init__(
        self,
        url: str,
        revision: str,
        head: str,
        differences: Sequence[str],
        *,
        repair_sql: Sequence[str] = (),
        matches: str | None = None,
    ) -> None:
        self.revision = revision
        self.head = head
        self.differences = tuple(differences)
        self.matches = None if repair_sql else matches
        if repair_sql:
            self.fix_sql = tuple(repair_sql)
        elif matches is not None:
            self.fix_sql = (f"UPDATE alembic_version SET version_num = '{matches}'",)
        else:
            self.fix_sql = ()
        message = (
            f"catalog {url} records schema revision {revision} but its tables differ from it: "
            f"{', '.join(self.differences)}; "
        )
        if repair_sql:
            message += f"repair it with the SQL `{'; '.join(self.fix_sql)}`, then retry"
        elif self.matches is not None:
            message += f"they match revision {matches} exactly: record that with the SQL "
            message += f"`{self.fix_sql[0]}`"
            if matches != head:
                message += f", then run `zephon db upgrade --catalog {url}`"
        else:
            message += _rebuild(url)
        super().__init__(url, message)


class MigrationsNotFoundError(CatalogError):
    """The catalog's Alembic migrations (``location``) hold no revision: a broken install, or
    a ``script_location`` that is not a migrations directory. No catalog can be opened."""

    def __init__(self, location: str) -> None:
        super().__init__(
            f"no catalog schema revisions in {location}; reinstall the zephon package (it "
            f"ships the migrations) or point script_location at its migrations directory",
            location=location,
        )


class RunNotFoundError(CatalogError):
    """No run of this name is in the catalog."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(
            f"run {run!r} is not in catalog {url}; list runs with `zephon runs`, or index "
            f"existing checkpoints with `zephon sync <storage URL>`",
            url=url,
            run=run,
        )


class RunExistsError(CatalogError):
    """``create_run`` was asked for a name that is already taken."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(
            f"run {run!r} already exists in catalog {url}; choose another name or use "
            f"ensure_run to reuse it",
            url=url,
            run=run,
        )


class RunConflictError(CatalogError):
    """A run name is already registered with a different identity (storage URL or kind)."""

    def __init__(self, url: str, run: str, field: str, existing: object, wanted: object) -> None:
        super().__init__(
            f"run {run!r} in catalog {url} has {field} {existing!r}, not {wanted!r}; a run "
            f"name belongs to one {field}: use another run name, or the original {field}",
            url=url,
            run=run,
            field=field,
            existing=existing,
            wanted=wanted,
        )


class CheckpointRecordNotFoundError(CatalogError):
    """No checkpoint record (row) for this (run, step); with ``save_id`` (``add_timings``), no
    row of that save: ``found_save`` is the save the row holds instead (None: no row at all).

    A missing catalog row, not a missing checkpoint: the project's one "no such checkpoint"
    error is ``storage.CheckpointNotFoundError``, which ``zephon`` raises to users."""

    def __init__(
        self,
        url: str,
        run: str,
        step: int,
        *,
        save_id: str | None = None,
        found_save: str | None = None,
    ) -> None:
        what = f"no checkpoint at step {step}"
        if save_id is not None:
            what += f" of save {save_id}"
            if found_save is not None:
                what += f" (the row holds save {found_save}: a newer save of the step)"
        super().__init__(
            f"run {run!r} has {what} in catalog {url}; list its steps "
            f"with `zephon checkpoints {run}`",
            url=url,
            run=run,
            step=step,
            save_id=save_id,
            found_save=found_save,
        )


class ReplicaNotFoundError(CheckpointRecordNotFoundError):
    """No replica row for this (run, step, tier, host): ``replica_started`` was never called."""

    def __init__(self, url: str, run: str, step: int, tier: str, host: str) -> None:
        CatalogError.__init__(
            self,
            f"run {run!r} has no {replica_label(tier, host)} at step {step} in catalog {url}; "
            f"record it with replica_started first, or list the replicas with "
            f"`zephon checkpoints {run} --json`",
            url=url,
            run=run,
            step=step,
            save_id=None,
            found_save=None,
            tier=tier,
            host=host,
        )


def replica_label(tier: str, host: str) -> str:
    """``local replica on host n1`` / ``save_dir replica``, for messages."""
    return f"{tier} replica on host {host}" if host else f"{tier} replica"


class InvalidTransitionError(CatalogError):
    """The checkpoint's current state does not allow the requested transition.

    ``state`` is the state found, ``action`` what was asked (``commit``, ``fail``, ``begin``,
    ``pin``...). Deterministic: retrying the same call gives the same answer.
    """

    def __init__(
        self, url: str, run: str, step: int, state: str, action: str, fix: str, **fields: Any
    ) -> None:
        super().__init__(
            f"cannot {action} run {run!r} step {step} in catalog {url}: it is {state}; {fix}",
            url=url,
            run=run,
            step=step,
            state=state,
            action=action,
            **fields,
        )

    @staticmethod
    def contended(
        url: str, run: str, step: int, action: str, tries: int, racers: str
    ) -> InvalidTransitionError:
        """State ``contended``: ``tries`` rounds of ``racers`` (concurrent begins, saves) kept
        re-arming the row under the caller, which gives up rather than loop for ever."""
        return InvalidTransitionError(
            url,
            run,
            step,
            "contended",
            action,
            f"{tries} concurrent {racers} raced for it; check for two jobs saving this run",
        )


class CheckpointExistsError(InvalidTransitionError):
    """``begin_checkpoint`` on a step that is already committed: it is never overwritten."""

    def __init__(self, url: str, run: str, step: int, path: str) -> None:
        super().__init__(
            url,
            run,
            step,
            "committed",
            "begin",
            f"a committed checkpoint ({path}) is never overwritten: resume from it or save "
            f"under another step",
            path=path,
        )


class StateConflictError(InvalidTransitionError):
    """A guarded update lost: the row is no longer the attempt the caller holds.

    Raised by ``mark_committed`` / ``mark_failed`` when another process re-armed the step
    (new ``save_id``) or moved it first. ``expected_save`` is the caller's save id,
    ``found_save`` the row's.
    """

    def __init__(
        self,
        url: str,
        run: str,
        step: int,
        state: str,
        action: str,
        expected_save: str,
        found_save: str | None,
    ) -> None:
        if found_save != expected_save:
            why = f"another process took the step over (save {found_save} replaced "
            why += f"{expected_save})"
        else:
            why = "another process moved it first"
        super().__init__(
            url,
            run,
            step,
            state,
            action,
            f"{why}; check for two jobs saving the same run with `zephon checkpoints {run}`",
            expected_save=expected_save,
            found_save=found_save,
        )


class FencedOutError(CatalogError):
    """A fenced call presented an epoch that is not the run's current attempt.

    ``epoch`` is the caller's, ``current`` the run's current attempt (None when the run never
    had a fenced attempt). Raised by ``register_attempt`` for an epoch not above the current
    one, and by every fenced call (``begin_checkpoint``, ``mark_committed``, ``update_run`` and
    ``claim_for_deletion`` with an epoch) unless the epoch is the current one. A process that
    sees it is a superseded attempt (a preempted job still running, say) and must stop
    saving: a newer attempt owns the run.
    """

    def __init__(self, url: str, run: str, epoch: int, current: AttemptRecord | None) -> None:
        where = f"run {run!r} in catalog {url}: attempt epoch {epoch}"
        stop = "this process is a stale attempt (a preempted job still running?): stop saving"
        register = "register the attempt with register_attempt before saving"
        if current is not None and current.epoch > epoch:
            message = f"{where} is no longer current: {current.describe()} took over; {stop}"
        elif current is not None and current.epoch == epoch:
            message = (
                f"{where} is already registered to attempt {current.attempt_id} "
                f"({current.process}); {stop}"
            )
        elif current is not None:
            message = f"{where} is not registered: the current one is {current.describe()}; "
            message += register
        else:
            message = f"{where} is not registered: the run has no fenced attempt yet; {register}"
        super().__init__(message, url=url, run=run, epoch=epoch, current=current)
