"""One run session: the lifecycle every entry point of a saving job shares.

The checkpoint manager, ``zephon.dcp.Writer``, the Hugging Face and accelerate callbacks,
Lightning's ``ZephonCheckpointIO`` and torchtitan's checkpointer each hold one ``RunSession``
and keep only their framework adapter. The session

- resolves the catalog: the argument (an open ``catalog.Catalog`` or its URL), else
  ``$ZEPHON_CATALOG_URL``, else none (storage alone decides); it is opened on the main process
  only, with the outage guard of ``zephon.outage``;
- records the run's row with the job's kind, total and retention;
- registers the job's attempt: at ``load_latest`` (``register_resuming``, by the resume path),
  or at the first save (``attempt_for_save``), resuming from the step the job loaded or
  declared (``resume_step``), else continuing the run's latest checkpoint;
- applies one frozen ``Retention`` after each commit (``retain``);
- chooses once where the job's saves go (``open_destination``: direct, or the local tier
  with a ``TierConfig``; ``zephon.destinations``).

Retention options are checked once, with one message, whichever entry point takes them
(``zephon.retention``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zephon.attempts import Attempt, register_writer
from zephon.catalog import UNSET, Catalog
from zephon.config import DEFAULT_CATALOG_OUTAGE_S
from zephon.destinations import Destination, TierConfig, choose_destination
from zephon.errors import ConfigError
from zephon.gc import apply_retention
from zephon.locations import CATALOG_URL_ENV, RunLocation
from zephon.outage import close_guard, ensure_run, open_catalog
from zephon.retention import Retention, check_resume_step, option_name

if TYPE_CHECKING:
    from zephon.collectives import Collectives

__all__ = [
    "CatalogArg",
    "Retention",
    "RunSession",
    "SessionParts",
    "check_resume_step",
    "resolve_catalog",
]

#: a job that keeps every checkpoint
NO_RETENTION = Retention()

#: what an entry point's ``catalog`` argument may be
CatalogArg = Catalog | str | None


def resolve_catalog(catalog: CatalogArg, owner: str = "") -> Catalog | str | None:
    """The catalog a job uses: ``catalog`` (an open ``Catalog`` or its URL), else
    ``$ZEPHON_CATALOG_URL``, else None (no catalog: storage alone decides)."""
    if catalog is not None and not isinstance(catalog, Catalog | str):
        raise ConfigError(
            f"{option_name(owner, 'catalog')} must be a catalog.Catalog or its URL, got "
            f"{type(catalog).__name__}"
        )
    if isinstance(catalog, str) and "://" not in catalog:
        raise ConfigError(
            f"{option_name(owner, 'catalog')} = {catalog!r} is invalid: use a SQLAlchemy URL such "
            "as sqlite:///catalog.db or postgresql+psycopg://host/db"
        )
    if catalog is None:
        catalog = os.environ.get(CATALOG_URL_ENV) or None
    return catalog


class RunSession:
    """One job's session with its run (see the module docstring). Construct it on every
    process; the catalog, the attempt and retention live on the main process (``is_main``).

    ``kind``/``total_steps`` describe the run's row (``total_steps`` left ``catalog.UNSET``
    by an entry point with no notion of a total: the row's stays as it is; None clears it);
    ``resume_step`` is the step the job
    declared it resumed from (``note_loaded`` records the step it loaded, which wins);
    ``on_corrupt`` is called for a damaged checkpoint passed over while registering;
    ``retention`` None leaves the run's policy as the catalog holds it (a tool writing into
    someone else's run: ``zephon adopt``), keeping everything without a catalog."""

    def __init__(
        self,
        location: RunLocation,
        *,
        catalog: CatalogArg = None,
        retention: Retention | None = NO_RETENTION,
        kind: str = "train",
        total_steps: Any = UNSET,
        resume_step: int | None = None,
        catalog_outage_s: float = DEFAULT_CATALOG_OUTAGE_S,
        is_main: bool = True,
        on_corrupt: Callable[[int, str], None] | None = None,
    ) -> None:
        self.location = location
        #: whether the job's retention is the run's policy (else the catalog's stays)
        self.sets_retention = retention is not None
        self.retention = retention if retention is not None else NO_RETENTION
        self.kind = kind
        self.total_steps = total_steps
        self.resume_step = resume_step
        self.catalog_outage_s = catalog_outage_s
        self.is_main = is_main
        self.on_corrupt = on_corrupt
        self._catalog_arg = resolve_catalog(catalog)
        self._owns_catalog = isinstance(self._catalog_arg, str)
        self._catalog: Catalog | None = None
        self._row_ensured = False
        #: main process: the job's attempt (registered by the resume path or the first save)
        self.attempt: Attempt | None = None
        #: main process: the step the job loaded, its resume point unless it declared one
        self.loaded_step: int | None = None
        #: where the job's saves go, once chosen (``open_destination``)
        self.destination: Destination | None = None
        self._closed = False

    # -- the catalog ------------------------------------------------------------------------

    @property
    def has_catalog(self) -> bool:
        """Whether this job records its run in a catalog (known before it is opened)."""
        return self._catalog_arg is not None

    @property
    def catalog(self) -> Catalog | None:
        """Main process: the catalog with this run's row (opened at first use); None
        without one, on every other process, and once the session is closed."""
        if not self.is_main or self._catalog_arg is None or self._closed:
            return None
        if self._catalog is None:
            arg = self._catalog_arg
            self._catalog = (
                arg if isinstance(arg, Catalog) else open_catalog(arg, self.catalog_outage_s)
            )
        if not self._row_ensured:
            self._ensure_row(self._catalog)
        return self._catalog

    def _ensure_row(self, catalog: Catalog) -> None:
        """The run's row with the job's kind, total and retention; owed to the catalog
        while it cannot be reached (``zephon.outage``)."""
        location, retention = self.location, self.retention
        given: dict[str, Any] = {}
        if self.total_steps is not UNSET:
            given["total_steps"] = self.total_steps
        if self.sets_retention:
            given["num_to_keep"] = retention.num_to_keep
            given["keep_every_steps"] = retention.keep_every_steps
        try:
            ensure_run(
                catalog,
                location,
                lambda: catalog.ensure_run(
                    location.name,
                    location.store.location.canonical_url,
                    kind=self.kind,
                    status="active",
                    **given,
                ),
            )
        except BaseException:
            self.close_catalog()
            raise
        self._row_ensured = True

    # -- the attempt ------------------------------------------------------------------------

    def note_loaded(self, step: int | None) -> None:
        """The job loaded ``step`` without registering (a reader, or a framework that loads
        by path): its first save resumes from it."""
        self.loaded_step = step

    @property
    def declared_resume(self) -> int | None:
        """Where the job resumes: the step it loaded, else the step it declared, else None
        (it continues the run's latest checkpoint)."""
        return self.loaded_step if self.loaded_step is not None else self.resume_step

    def attempt_for_save(self) -> Attempt:
        """Main process: the job's attempt, registered now if the job has none yet (see
        ``zephon.attempts.register_writer``)."""
        if self.attempt is None:
            self.attempt = register_writer(
                self.location,
                self.catalog,
                resume_step=self.declared_resume,
                on_corrupt=self.on_corrupt,
            )
        return self.attempt

    # -- retention --------------------------------------------------------------------------

    def retain(self) -> list[int]:
        """Main process: delete what the retention no longer keeps (``zephon.gc``'s fenced
        retention: with a catalog the run's policy, pins included). Returns the deleted
        steps; [] on other processes or before the job has an attempt."""
        if not self.is_main or self.attempt is None:
            return []
        return apply_retention(
            self.location,
            self.catalog,
            self.attempt.fence,
            self.retention.num_to_keep,
            self.retention.keep_every_steps,
        )

    # -- the destination --------------------------------------------------------------------

    def open_destination(
        self, tier: TierConfig | None = None, coll: Collectives | None = None
    ) -> Destination:
        """Choose, once, where this job's saves go: the local tier when ``tier`` names a
        ``local_dir`` (collective: every process, at the same point, ``coll`` the job's
        process group), else straight to storage (``zephon.destinations``)."""
        if self.destination is not None:
            raise RuntimeError("this run session chose its destination already")
        self.destination = choose_destination(self, tier, coll)
        return self.destination

    # -- the end ----------------------------------------------------------------------------

    def close_catalog(self) -> None:
        """Close a catalog this session opened from its URL (paying what it owes first); a
        catalog the caller passed open stays open."""
        catalog, self._catalog = self._catalog, None
        self._row_ensured = False
        if catalog is not None and self._owns_catalog:
            close_guard(catalog)
            with contextlib.suppress(Exception):
                catalog.close()

    def close(self) -> None:
        """Close the destination (its background work stops after its queue), then the
        catalog (the store is its owner's)."""
        destination, self.destination = self.destination, None
        try:
            if destination is not None:
                destination.close()  # its last uploads still record in the catalog
        finally:
            self._closed = True
            self.close_catalog()


class SessionParts:
    """For an object that holds its run's ``session`` (None until it starts): the session's
    catalog and attempt as its own attributes (main process; None elsewhere or before)."""

    session: RunSession | None

    @property
    def catalog(self) -> Catalog | None:
        """The catalog with the run's row, or None (no catalog: storage alone decides)."""
        return self.session.catalog if self.session is not None else None

    @property
    def attempt(self) -> Attempt | None:
        """This job's attempt, once registered (by its resume or its first save)."""
        return self.session.attempt if self.session is not None else None
