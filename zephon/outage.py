"""Catalog outages: a job keeps saving while its catalog is unreachable (docs/catalog.md,
"When the catalog is down").

Storage is the source of truth and its fence needs no catalog, so nothing a save must get right
depends on the catalog answering: a save that cannot reach it commits to storage under the
storage fence alone, and what the catalog missed is *owed* to it. One ``OutageGuard`` per
``Catalog`` object keeps that debt, per run, as named steps run in a fixed order:

- ``run``: the run's row (a job that started with the catalog down);
- ``rows``: attempts and checkpoint rows, brought in line with storage by the one rule
  (``zephon.sync.reconcile_run``: a marker without a row is recorded, a pending row whose marker
  exists promoted, an unregistered attempt or decision mirrored);
- ``retention``: the job's retention, which only ever deletes through the catalog's fenced
  claims (never on a guess made without it);
- ``finish``: the run marked finished.

Every catalog call of the save path goes through ``OutageGuard.call``: bounded retries with
backoff (a few seconds, once per outage: a save never waits long for a catalog that is known to
be down), then the caller defers its step. The next save pays the debt first (before its own
row is armed, so the catalog knows the attempt that saves), and a background thread retries with
backoff meanwhile. Once the catalog has been unreachable for longer than the deadline
(``catalog_outage_s``), the next call raises ``CatalogOutageError``: a job never dies of a
shorter outage, and never runs for long unseen by its catalog. ``zephon sync`` remains the
fallback for whatever a job could not pay before it ended.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from zephon import catalog as catalog_layer
from zephon.catalog import Catalog, CatalogUnavailableError, CheckpointState, RunNotFoundError
from zephon.config import DEFAULT_CATALOG_OUTAGE_S
from zephon.errors import CatalogOutageError, StaleAttemptError
from zephon.locations import RunLocation

__all__ = [
    "DebtBeingPaid",
    "OutageGuard",
    "close_guard",
    "ensure_run",
    "guard",
    "open_catalog",
    "record_missed",
]

T = TypeVar("T")

log = logging.getLogger("zephon")

#: retries of one catalog step inside a save, while the outage is new
RETRY_IN_SAVE_S = 3.0
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0
#: owed steps, in the order they are paid
_ORDER = ("run", "rows", "retention", "finish")
#: how long a save waits for the background thread's payment before it goes on without
_PAY_WAIT_S = 1.0


class DebtBeingPaid(Exception):
    """``OutageGuard.pay`` could not take its turn: the background payer holds the run's debt
    (a slow connection attempt). Says nothing about whether the catalog answers: callers go on
    as if it did not, and the debt stays with the background payer."""


class OutageGuard:
    """The outage state of one ``Catalog`` and what it owes each run; see the module
    docstring. Thread-safe: the job's threads and the background payer share it."""

    def __init__(self, catalog: Catalog, deadline_s: float = DEFAULT_CATALOG_OUTAGE_S) -> None:
        self.catalog = catalog
        self.deadline_s = deadline_s
        self._state = threading.Lock()
        #: held while paying a debt (a save's payment and the background's never interleave)
        self._paying = threading.RLock()
        self._down_since: float | None = None
        self._last: CatalogUnavailableError | None = None
        self._owed: dict[str, tuple[RunLocation, dict[str, Callable[[], object]]]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        #: the URL of a catalog opened during an outage, whose schema check is owed
        self.unchecked_url: str | None = None

    # -- the outage ---------------------------------------------------------------------------

    @property
    def down(self) -> bool:
        """Whether the last catalog call through this guard failed to reach the catalog."""
        return self._down_since is not None

    def unreachable(self, exc: CatalogUnavailableError) -> None:
        """Note that a catalog call failed to reach it (the outage starts now, if it is new)."""
        with self._state:
            self._last = exc
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning(
                    "zephon: %s; saves go on to storage and the catalog is brought up to date "
                    "once it answers (failing after catalog_outage_s = %gs)",
                    exc,
                    self.deadline_s,
                )

    def _answered(self) -> None:
        with self._state:
            if self._down_since is not None:
                log.info(
                    "zephon: catalog %s answers again after %.1fs",
                    self.catalog.url,
                    time.monotonic() - self._down_since,
                )
            self._down_since = None

    def check_deadline(self) -> None:
        """Raise ``CatalogOutageError`` if the catalog has been unreachable for longer than
        the deadline."""
        since, last = self._down_since, self._last
        if since is None or last is None:
            return
        elapsed = time.monotonic() - since
        if elapsed > self.deadline_s:
            raise CatalogOutageError(
                self.catalog.url, elapsed=elapsed, deadline_s=self.deadline_s, reason=last.reason
            )

    def call(self, fn: Callable[[], T], *, retry_s: float | None = None) -> T:
        """``fn()``, a catalog step, retried with backoff while the catalog is unreachable:
        for ``retry_s`` (default ``RETRY_IN_SAVE_S``, or one try while an outage is already
        known). Raises the last ``CatalogUnavailableError``, or ``CatalogOutageError`` once
        the catalog has been unreachable for longer than the deadline (a catalog that answers
        again is used, however long it was away)."""
        if retry_s is None:
            retry_s = 0.0 if self.down else RETRY_IN_SAVE_S
        give_up = time.monotonic() + retry_s
        delay = _BACKOFF_FIRST_S
        while True:
            try:
                result = fn()
            except CatalogUnavailableError as exc:
                self.unreachable(exc)
                self.check_deadline()
                if time.monotonic() + delay > give_up:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            self._answered()
            return result

    # -- what the catalog is owed -------------------------------------------------------------

    def defer(self, location: RunLocation, step: str, fn: Callable[[], object]) -> None:
        """Owe ``step`` (one of ``run``, ``rows``, ``retention``, ``finish``) of ``location``'s
        run to the catalog: ``fn`` pays it (the newest ``fn`` of a step wins), before the
        next save's own catalog steps or in the background, whichever comes first."""
        assert step in _ORDER, step
        with self._state:
            _, steps = self._owed.setdefault(location.name, (location, {}))
            steps[step] = fn
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._pay_in_background, name="zephon-catalog-outage", daemon=True
                )
                self._thread.start()

    def defer_rows(self, location: RunLocation) -> None:
        """Owe the run's attempts and checkpoint rows: reconciled with storage by the one
        rule once the catalog answers."""
        from zephon.sync import SyncReport, reconcile_run  # sync imports the save path

        catalog = self.catalog

        def reconcile() -> None:
            reconcile_run(catalog, location, SyncReport(location.store.url), pending=True)

        self.defer(location, "rows", reconcile)

    def owes(self, location: RunLocation) -> bool:
        return location.name in self._owed

    def pay(self, location: RunLocation) -> None:
        """Pay what ``location``'s run owes, in order (nothing if it owes nothing). Raises
        ``CatalogUnavailableError`` while the catalog is down (what is left stays owed), and
        ``DebtBeingPaid`` if the background payer holds the debt for longer than a moment.
        The retention of an attempt a newer one replaced is dropped, never run. Call it inside
        ``call`` together with the catalog step that needs the debt paid first, so that a
        success says the catalog answered."""
        if not self.owes(location):
            return
        if not self._paying.acquire(timeout=_PAY_WAIT_S):
            raise DebtBeingPaid(location.name)
        try:
            self._pay(location)
        finally:
            self._paying.release()

    def _pay(self, location: RunLocation) -> None:
        with self._state:
            entry = self._owed.get(location.name)
            steps = dict(entry[1]) if entry is not None else {}
        for step in sorted(steps, key=_ORDER.index):
            try:
                steps[step]()
            except CatalogUnavailableError:
                raise  # still owed
            except (StaleAttemptError, catalog_layer.FencedOutError) as exc:
                # a newer attempt took over: its own saves and retention speak for the run now
                log.info("zephon: run %s: deferred %s dropped: %s", location.name, step, exc)
            except Exception as exc:  # noqa: BLE001 - never fails a save; sync is the fallback
                log.warning(
                    "zephon: run %s: the catalog could not be brought up to date (%s: %s); "
                    "run `zephon sync %s` once the cause is fixed",
                    location.name,
                    step,
                    exc,
                    location.store.url,
                )
            with self._state:
                owed = self._owed.get(location.name)
                if owed is not None and owed[1].get(step) is steps[step]:
                    del owed[1][step]
                    if not owed[1]:
                        del self._owed[location.name]

    def _pay_in_background(self) -> None:
        delay = _BACKOFF_FIRST_S
        while not self._stop.wait(delay):
            with self._state:
                locations = [location for location, _ in self._owed.values()]
            if not locations:
                return
            for location in locations:
                try:
                    self.call(lambda location=location: self.pay(location), retry_s=0)
                    delay = _BACKOFF_FIRST_S
                except (CatalogUnavailableError, CatalogOutageError, DebtBeingPaid):
                    delay = min(delay * 2, _BACKOFF_MAX_S)
                except Exception:  # noqa: BLE001 - the thread must live on; retried with backoff
                    log.debug("zephon: paying the catalog failed", exc_info=True)
                    delay = min(delay * 2, _BACKOFF_MAX_S)

    def close(self) -> None:
        """Stop the background payer after one last try to pay everything owed; what is
        still owed is logged with the fix (``zephon sync``). Never raises."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=30)
        with self._state:
            locations = [location for location, _ in self._owed.values()]
        for location in locations:
            with contextlib.suppress(Exception):
                self.call(lambda location=location: self.pay(location), retry_s=0)
            if self.owes(location):
                log.warning(
                    "zephon: run %s: catalog %s is still unavailable; checkpoints committed "
                    "meanwhile are on storage: run `zephon sync %s` once it answers",
                    location.name,
                    self.catalog.url,
                    location.store.url,
                )
        with self._state:
            self._owed.clear()


_GUARDS: weakref.WeakKeyDictionary[Catalog, OutageGuard] = weakref.WeakKeyDictionary()
_GUARDS_LOCK = threading.Lock()


def guard(catalog: Catalog, deadline_s: float | None = None) -> OutageGuard:
    """The ``OutageGuard`` of ``catalog`` (one per ``Catalog`` object, shared by every save
    path that uses it); ``deadline_s`` sets its deadline (``catalog_outage_s``)."""
    with _GUARDS_LOCK:
        found = _GUARDS.get(catalog)
        if found is None:
            found = _GUARDS[catalog] = OutageGuard(catalog)
        if deadline_s is not None:
            found.deadline_s = deadline_s
        return found


def close_guard(catalog: Catalog) -> None:
    """Before ``catalog.close()``: pay what can be paid, stop the background payer."""
    with _GUARDS_LOCK:
        found = _GUARDS.pop(catalog, None)
    if found is not None:
        found.close()


def open_catalog(url: str, deadline_s: float | None = None) -> Catalog:
    """``Catalog(url)`` for a job, with its guard's deadline (``catalog_outage_s``); a catalog
    that cannot be reached is opened all the same, its schema check owed with the run's row
    (``ensure_run``): the job starts from storage and the catalog catches up once it
    answers."""
    try:
        catalog = Catalog(url)
    except CatalogUnavailableError as exc:
        catalog = Catalog(url, check_schema=False)
        outage = guard(catalog, deadline_s)
        outage.unchecked_url = url
        outage.unreachable(exc)
        return catalog
    guard(catalog, deadline_s)
    return catalog


def ensure_run(catalog: Catalog, location: RunLocation, ensure: Callable[[], object]) -> None:
    """``ensure()``, which creates or updates the run's row (``catalog.ensure_run``), now, or
    owed to the catalog while it cannot be reached (with the schema check of a catalog
    ``open_catalog`` opened during the outage, first)."""
    outage = guard(catalog)

    def run_row() -> None:
        url = outage.unchecked_url
        if url is not None:
            Catalog(url).close()  # the schema check opening the catalog skipped
            outage.unchecked_url = None
        ensure()

    if not outage.down:
        try:
            outage.call(run_row)
            return
        except CatalogUnavailableError:
            pass
    outage.defer(location, "run", run_row)


def record_missed(
    catalog: Catalog, location: RunLocation, committed: list[int] | None = None
) -> None:
    """At a job start: record what an earlier process of the run committed on storage while
    the catalog was down and could not report before it ended (a committed step above the
    catalog's newest committed row that it has no row of), by the one rule, before the new
    attempt chooses where it resumes: it would otherwise resume below them and abandon them.
    One listing of the run's steps (``committed``, if the caller listed them already); the
    reconciliation only when something was missed."""
    from zephon.sync import SyncReport, reconcile_run  # sync imports the save path

    if committed is None:
        committed = location.runstore.committed_steps()
    if not committed:
        return
    try:
        newest = catalog.latest_committed(location.name)
    except RunNotFoundError:
        return  # the run's row is owed: its checkpoints get rows when it is paid
    floor = newest.step if newest is not None else None
    above = {step for step in committed if floor is None or step > floor}
    if not above:
        return
    rows = catalog.rows_after(location.name, floor, states=list(CheckpointState))
    if above - {row.step for row in rows}:
        reconcile_run(catalog, location, SyncReport(location.store.url), pending=False)
