"""Attempts: one start of a job that writes a run's checkpoints, with its fencing token.

An attempt is registered once it knows where it resumes from (``register``): storage hands out
the epoch (a create-only attempt record, so two starts never share one), then the catalog, if
there is one, records it and in the same transaction abandons every older epoch's checkpoint
above the resume point. From then on every write of an older attempt is refused where it lands:
the catalog's guarded transitions and claims, storage's ``begin`` and the re-check just before
the marker.

``fenced`` turns the storage and catalog layers' ``StaleAttemptError`` into the one
``zephon.StaleAttemptError`` users catch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

import catalog as catalog_layer
import storage
from catalog import Catalog
from storage import AttemptRecord, Fence, Lineage
from zephon.errors import StaleAttemptError
from zephon.locations import RunLocation

__all__ = ["Attempt", "fenced", "mirror_lineage", "register"]

log = logging.getLogger("zephon")

#: how often ``register`` decides again when another start takes the epoch it wanted
_REGISTER_TRIES = 5


@dataclass(frozen=True, slots=True)
class Attempt:
    """The current attempt of a run, as the process that holds it sees it."""

    location: RunLocation
    fence: Fence

    @property
    def epoch(self) -> int:
        return self.fence.epoch

    @property
    def resumed_from(self) -> int | None:
        return self.fence.record.resumed_from

    @property
    def record(self) -> AttemptRecord:
        return self.fence.record


@contextlib.contextmanager
def fenced() -> Iterator[None]:
    """Raise ``zephon.StaleAttemptError`` for a stale attempt refused by either layer."""
    try:
        yield
    except (storage.StaleAttemptError, catalog_layer.StaleAttemptError) as exc:
        raise StaleAttemptError(str(exc), current=exc.current) from exc


def _started(record: AttemptRecord) -> datetime:
    try:
        return datetime.fromisoformat(record.started_at)
    except ValueError:
        return datetime.now().astimezone()


def _register_in_catalog(catalog: Catalog, name: str, record: AttemptRecord) -> None:
    catalog.register_attempt(
        name,
        epoch=record.epoch,
        attempt_id=record.attempt_id,
        host=record.host,
        pid=record.pid,
        started_at=_started(record),
        resumed_from=record.resumed_from,
    )


def register(
    location: RunLocation,
    catalog: Catalog | None,
    *,
    lineage: Lineage,
    resumed_from: int | None,
) -> Attempt:
    """Register a new attempt of the run that resumes from ``resumed_from`` (None: from
    nothing), decided under ``lineage``. Raises ``zephon.StaleAttemptError`` when another
    start registered since ``lineage`` was read: the caller decides again."""
    store, storage_run, name = location.store, location.storage_run, location.name
    with fenced():
        floor = 1
        if catalog is not None:
            mirror_lineage(catalog, location, lineage)
            current = catalog.current_attempt(name)
            floor = current.epoch + 1 if current is not None else 1
        fence = store.claim_attempt(
            storage_run, after=lineage, resumed_from=resumed_from, min_epoch=floor
        )
        if catalog is not None:
            _register_in_catalog(catalog, name, fence.record)
    log.info(
        "zephon: run %s: attempt %s registered, resuming from %s",
        name,
        fence.record.describe(),
        "nothing" if resumed_from is None else f"step {resumed_from}",
    )
    return Attempt(location, fence)


def register_resuming(
    location: RunLocation,
    catalog: Catalog | None,
    choose: callable,
) -> tuple[Attempt, object]:
    """Register an attempt whose resume point ``choose(lineage)`` decides (it returns
    ``(step or None, anything)``); decided again if another start registered meanwhile.
    Returns the attempt and what ``choose`` returned with the step."""
    last: StaleAttemptError | None = None
    for _ in range(_REGISTER_TRIES):
        lineage = location.store.lineage(location.storage_run)
        step, found = choose(lineage)
        try:
            return register(location, catalog, lineage=lineage, resumed_from=step), found
        except StaleAttemptError as exc:
            last = exc
    assert last is not None
    raise last


def mirror_lineage(catalog: Catalog, location: RunLocation, lineage: Lineage) -> None:
    """Register in the catalog the attempts storage knows and it does not (attempts that ran
    without this catalog), oldest first, so its rows are abandoned as storage's lineage says.
    Costs nothing when the catalog is up to date (the usual case)."""
    if not lineage:
        return
    current = catalog.current_attempt(location.name)
    known = current.epoch if current is not None else 0
    if lineage.epoch <= known:
        return
    for record in location.store.attempts(location.storage_run):
        if record.epoch > known:
            with contextlib.suppress(catalog_layer.StaleAttemptError):
                _register_in_catalog(catalog, location.name, record)
