"""The catalog layer's exceptions: one root, and specific subclasses that carry their data.

Every message names the object (database URL with the password masked, run, step) and the fix,
so the ``zephon`` CLI can print ``str(exc)`` as its one-line error. Callers that need to branch
read the attributes, never the message text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # records import models; errors stay importable on their own
    from catalog.records import AttemptRecord


class CatalogError(Exception):
    """Root of every error the catalog layer raises on purpose."""


class InvalidValueError(CatalogError, ValueError):
    """An argument is out of range (run name, step, retention value, URL with a password).

    Raised before the database is touched; the message names the argument, the value and what
    is allowed.
    """

    def __init__(self, argument: str, value: object, allowed: str) -> None:
        self.argument = argument
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {argument} {value!r}: {allowed}")


class CatalogUnavailableError(CatalogError):
    """The catalog database cannot be reached or answered with a connection-level failure."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(
            f"catalog {url} is unavailable: {reason}; check that the database server is "
            f"running and the URL (--catalog or ZEPHON_CATALOG_URL) is right"
        )


class CatalogDatabaseError(CatalogError):
    """The database rejected a statement for a reason other than connectivity.

    Seeing this means a bug or a schema edited by hand; the message keeps the driver's reason.
    """

    def __init__(self, url: str, action: str, reason: str) -> None:
        self.url = url
        self.action = action
        self.reason = reason
        super().__init__(
            f"catalog {url} failed to {action}: {reason}; check the schema with "
            f"`zephon db current --catalog {url}` and report this if it persists"
        )


class SchemaError(CatalogError):
    """The database's schema is not one this code can work with."""

    def __init__(self, url: str, message: str) -> None:
        self.url = url
        super().__init__(message)


class SchemaOutdatedError(SchemaError):
    """The schema revision differs from the code's head: behind it, or unknown to this code.

    ``current`` is the revision found (``None``: an ``alembic_version`` table without a row),
    ``head`` the revision this code needs, ``known`` whether this code's migrations contain
    ``current`` (``False`` usually means a newer Zephon wrote the database).
    """

    def __init__(self, url: str, current: str | None, head: str, *, known: bool) -> None:
        self.current = current
        self.head = head
        self.known = known
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
        super().__init__(url, message)


class SchemaUnversionedError(SchemaError):
    """Catalog tables exist but no ``alembic_version`` table says which revision they are."""

    def __init__(self, url: str, tables: list[str]) -> None:
        self.tables = tables
        super().__init__(
            url,
            f"catalog {url} has tables {', '.join(tables)} but no alembic_version table, so "
            f"its schema revision is unknown; point --catalog at an empty database, or drop "
            f"these tables and run `zephon db upgrade --catalog {url}` followed by "
            f"`zephon sync` to rebuild the index from storage",
        )


class RunNotFoundError(CatalogError):
    """No run of this name is in the catalog."""

    def __init__(self, url: str, run: str) -> None:
        self.url = url
        self.run = run
        super().__init__(
            f"run {run!r} is not in catalog {url}; list runs with `zephon runs`, or index "
            f"existing checkpoints with `zephon sync <storage URL>`"
        )


class RunExistsError(CatalogError):
    """``create_run`` was asked for a name that is already taken."""

    def __init__(self, url: str, run: str) -> None:
        self.url = url
        self.run = run
        super().__init__(
            f"run {run!r} already exists in catalog {url}; choose another name or use "
            f"ensure_run to reuse it"
        )


class RunConflictError(CatalogError):
    """A run name is already registered with a different identity (storage URL or kind)."""

    def __init__(self, url: str, run: str, field: str, existing: object, wanted: object) -> None:
        self.url = url
        self.run = run
        self.field = field
        self.existing = existing
        self.wanted = wanted
        super().__init__(
            f"run {run!r} in catalog {url} has {field} {existing!r}, not {wanted!r}; a run "
            f"name belongs to one {field}: use another run name, or the original {field}"
        )


class CheckpointNotFoundError(CatalogError):
    """No row for this (run, step)."""

    def __init__(self, url: str, run: str, step: int) -> None:
        self.url = url
        self.run = run
        self.step = step
        super().__init__(
            f"run {run!r} has no checkpoint at step {step} in catalog {url}; list its steps "
            f"with `zephon checkpoints {run}`"
        )


class InvalidTransitionError(CatalogError):
    """The checkpoint's current state does not allow the requested transition.

    ``state`` is the state found, ``action`` what was asked (``commit``, ``fail``, ``begin``,
    ``pin``...). Deterministic: retrying the same call gives the same answer.
    """

    def __init__(self, url: str, run: str, step: int, state: str, action: str, fix: str) -> None:
        self.url = url
        self.run = run
        self.step = step
        self.state = state
        self.action = action
        super().__init__(
            f"cannot {action} run {run!r} step {step} in catalog {url}: it is {state}; {fix}"
        )


class CheckpointExistsError(InvalidTransitionError):
    """``begin_checkpoint`` on a step that is already committed: it is never overwritten."""

    def __init__(self, url: str, run: str, step: int, path: str) -> None:
        self.path = path
        super().__init__(
            url,
            run,
            step,
            "committed",
            "begin",
            f"a committed checkpoint ({path}) is never overwritten: resume from it or save "
            f"under another step",
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
        self.expected_save = expected_save
        self.found_save = found_save
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
        )


class StaleAttemptError(CatalogError):
    """A fenced call presented an epoch that is not the run's current attempt.

    ``epoch`` is the caller's, ``current`` the run's current attempt (None when the run never
    had a fenced attempt). Raised by ``register_attempt`` for an epoch not above the current
    one, and by every fenced call (``begin_checkpoint``, ``mark_committed``, ``update_run`` and
    ``claim_for_deletion`` with an epoch) unless the epoch is the current one. A process that
    sees it is a superseded attempt (a preempted job still running, say) and must stop
    saving: a newer attempt owns the run.
    """

    def __init__(self, url: str, run: str, epoch: int, current: AttemptRecord | None) -> None:
        self.url = url
        self.run = run
        self.epoch = epoch
        self.current = current
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
        super().__init__(message)
