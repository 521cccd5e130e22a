"""Attempts: one start of a job that writes a run's checkpoints, with its fencing token.

An attempt is registered in two steps. ``claim``: storage hands out the epoch (a create-only
attempt record, so two starts never share one) and the catalog, if there is one, records it;
from then on every write of an older attempt is refused where it lands (the catalog's guarded
transitions and claims, storage's ``begin`` and the re-check just before the marker). Then the
attempt chooses where it resumes, on ground nobody else can move, and ``decide`` records it:
on storage, then in the catalog, which abandons every older epoch's checkpoint above it in the
same transaction.

A job that only reads a run never registers one: an attempt is what a *writer* holds, and a
writer that did not register when it loaded (or never loaded) registers at its first save with
``register_writer``. Unless the job declared where it resumes, that attempt continues the run's
latest complete checkpoint, and ``Attempt.check_save`` refuses a save below it: a job that
started over by mistake must not mix a second history into the run.

With the catalog unreachable (``zephon.outage``), the claim and the decision are made on
storage alone, which hands out the epoch and keeps the fence without a catalog; the catalog's
record of them is owed, and mirrored from storage (``mirror_lineage``) once it answers.

``fenced`` turns the storage and catalog layers' ``FencedOutError`` into the one
``zephon.StaleAttemptError`` users catch (``zephon.errors.as_zephon_error``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from zephon import catalog as catalog_layer
from zephon import storage
from zephon.catalog import Catalog, CatalogUnavailableError
from zephon.errors import SaveBelowLatestError, StaleAttemptError, ZephonError, as_zephon_error
from zephon.locations import RunLocation
from zephon.outage import DebtBeingPaid, guard, record_missed
from zephon.storage import AttemptRecord, Fence, Lineage

__all__ = [
    "UNREAD",
    "Attempt",
    "PendingAttempt",
    "Registration",
    "as_zephon_error",
    "claim",
    "decide",
    "fenced",
    "mirror_lineage",
    "register",
    "register_resuming",
    "register_writer",
]

T = TypeVar("T")

#: ``mirror_lineage``'s ``current`` when the caller has not read the current attempt
UNREAD = object()

log = logging.getLogger("zephon")

#: attempt ids of this process's claims that were chosen on but are not written yet
#: (``Registration``): ``mirror_lineage`` has nothing to learn from a lineage they head
_UNWRITTEN: set[str] = set()

#: how often ``register`` decides again when another start takes the epoch it wanted
_REGISTER_TRIES = 5


@dataclass(frozen=True, slots=True)
class Attempt:
    """The current attempt of a run, as the process that holds it sees it."""

    location: RunLocation
    fence: Fence
    #: registered to continue the run's latest complete checkpoint, not at a resume point the
    #: job declared (or loaded): a save below ``resumed_from`` is refused (``check_save``)
    implicit: bool = False

    @property
    def epoch(self) -> int:
        return self.fence.epoch

    @property
    def resumed_from(self) -> int | None:
        return self.fence.record.resumed_from

    @property
    def record(self) -> AttemptRecord:
        return self.fence.record

    def check_save(self, step: int) -> None:
        """Refuse (``SaveBelowLatestError``) a save of ``step`` below the latest checkpoint an
        implicit attempt continues: the job restarted from scratch without saying so (a resume
        that found nothing, Lightning's ``last.ckpt`` that is not there) and would commit a
        second history into the run, found out only when it reaches a step that exists."""
        latest = self.resumed_from
        if self.implicit and latest is not None and step < latest:
            raise SaveBelowLatestError(
                f"run {self.location.name}: refusing to save step {step} below its latest "
                f"checkpoint {latest} (this job did not resume from it): resume from LATEST "
                "(load_latest, ckpt_path=LATEST) or declare where the job resumes (resume_step=N)",
                run=self.location.name,
                step=step,
                latest=latest,
            )


@contextlib.contextmanager
def fenced() -> Iterator[None]:
    """Raise ``zephon.StaleAttemptError`` for a stale attempt refused by either layer."""
    try:
        yield
    except (storage.FencedOutError, catalog_layer.FencedOutError) as exc:
        raise as_zephon_error(exc) from exc


def _started(record: AttemptRecord) -> datetime:
    try:
        return datetime.fromisoformat(record.started_at)
    except ValueError:
        return datetime.now().astimezone()


def _register_in_catalog(catalog: Catalog, name: str, record: AttemptRecord) -> None:
    """Mirror a storage attempt record: registered, and decided if it is."""
    given = {"resumed_from": record.resumed_from} if record.decided else {}
    catalog.register_attempt(
        name,
        epoch=record.epoch,
        attempt_id=record.attempt_id,
        host=record.host,
        pid=record.pid,
        started_at=_started(record),
        **given,
    )


def claim(location: RunLocation, catalog: Catalog | None, lineage: Lineage) -> Fence:
    """Claim the run's next epoch on storage and in the catalog: from here on every older
    attempt is fenced out, and nothing is abandoned yet (the attempt has not decided)."""
    floor, online = _floor(location, catalog, lineage)
    return _claim_at(location, catalog, lineage, floor, online)


def _floor(
    location: RunLocation,
    catalog: Catalog | None,
    lineage: Lineage,
    committed: list[int] | None = None,
) -> tuple[int, bool]:
    """The lowest epoch the catalog allows the next claim (its attempts mirrored from storage
    first, and steps committed without a row recorded: ``committed``, the run's committed
    steps if already listed), and whether it answered; ``(1, False)`` without a catalog."""
    if catalog is None:
        return 1, False
    outage = guard(catalog)

    def catalog_floor() -> int:
        outage.pay(location)
        mirror_lineage(catalog, location, lineage)
        record_missed(catalog, location, committed)
        current = catalog.current_attempt(location.name)
        return current.epoch + 1 if current is not None else 1

    with fenced():
        try:
            return outage.call(catalog_floor), True
        except (CatalogUnavailableError, DebtBeingPaid):
            return 1, False  # storage alone hands out the epoch; the catalog mirrors it later


def _claim_at(
    location: RunLocation,
    catalog: Catalog | None,
    lineage: Lineage,
    floor: int,
    online: bool,
    attempt_id: str | None = None,
) -> Fence:
    """The claim's writes: the create-only attempt record, then its catalog row."""
    with fenced():
        fence = location.store.run(location.storage_run).claim_attempt(
            after=lineage, min_epoch=floor, attempt_id=attempt_id
        )
        if catalog is not None:
            _owe_unless_done(
                catalog,
                location,
                lambda: _register_in_catalog(catalog, location.name, fence.record),
                online=online,
            )
    return fence


def _owe_unless_done(
    catalog: Catalog, location: RunLocation, change: Callable[[], None], *, online: bool
) -> None:
    """Make ``change`` in the catalog, retried while it is unreachable; if it stays so (or was
    found so before: ``online`` false, or a debt still owed), the run's attempts are owed and
    mirrored from storage once it answers."""
    outage = guard(catalog)
    if online and not outage.owes(location):
        try:
            outage.call(change)
            return
        except CatalogUnavailableError:
            pass
    outage.defer_rows(location)


def decide(
    location: RunLocation, catalog: Catalog | None, fence: Fence, resumed_from: int | None
) -> Attempt:
    """Record where the claimed attempt resumes, on storage then in the catalog (which
    abandons the older history above it in the same transaction)."""
    with fenced():
        fence = location.runstore.decide_resume(fence, resumed_from)
        if catalog is not None:
            _owe_unless_done(
                catalog,
                location,
                lambda: catalog.decide_resume(
                    location.name, epoch=fence.epoch, resumed_from=resumed_from
                ),
                online=not guard(catalog).down,
            )
    log.info(
        "zephon: run %s: attempt %s registered, resuming from %s",
        location.name,
        fence.record.describe(),
        "nothing" if resumed_from is None else f"step {resumed_from}",
    )
    return Attempt(location, fence)


def register(
    location: RunLocation,
    catalog: Catalog | None,
    *,
    lineage: Lineage,
    resumed_from: int | None,
) -> Attempt:
    """Register a new attempt that resumes from a step the caller already knows (None: from
    nothing), claimed after ``lineage``: ``claim`` then ``decide``. Raises
    ``zephon.StaleAttemptError`` when another start claimed since ``lineage`` was read."""
    return decide(location, catalog, claim(location, catalog, lineage), resumed_from)


def register_resuming(
    location: RunLocation,
    catalog: Catalog | None,
    choose: Callable[[Lineage], tuple[int | None, T]],
) -> tuple[Attempt, T]:
    """Register an attempt that chooses where it resumes *after* it fenced the older ones:
    claim the epoch, then ``choose(lineage)`` (the lineage with this attempt current and
    undecided) returns ``(step or None, anything)``, then decide. An older attempt therefore
    cannot commit, delete or retain anything between the choice and its record. Claimed
    again if another start took the epoch first. Returns the attempt and what ``choose``
    returned with the step."""
    last: StaleAttemptError | None = None
    for _ in range(_REGISTER_TRIES):
        try:
            fence = claim(location, catalog, location.runstore.lineage())
        except StaleAttemptError as exc:
            last = exc
            continue
        step, found = choose(fence.lineage)
        return decide(location, catalog, fence, step), found
    assert last is not None
    raise last


@dataclass(frozen=True, slots=True)
class Registration:
    """An attempt's registration, begun: the lineage read and the epoch its claim will take.

    ``register_resuming`` writes the claim, chooses, then writes the decision: on an object
    store five requests one after another before the job may load anything. Begun here, the
    job chooses ahead on ``lineage`` (the lineage as it will be once this attempt holds its
    epoch, undecided) and starts loading, while ``decide_in_background`` writes the claim,
    confirms the choice (an older attempt may have committed or deleted a checkpoint until
    the claim fenced it out: then it chooses again) and writes the decision: the protocol's
    order, claim then choice then decision, is kept (docs/fencing.md).
    ``PendingAttempt.wait`` says whether the choice the job loaded still stands. Rank 0 only.
    """

    location: RunLocation
    catalog: Catalog | None
    #: the lineage as read, before the claim
    read: Lineage
    floor: int
    online: bool
    #: the attempt id its record will hold
    attempt_id: str
    #: the run's committed steps, listed with the lineage (before anything was chosen)
    committed: list[int]

    @classmethod
    def begin(cls, location: RunLocation, catalog: Catalog | None) -> Registration:
        """Read the run's lineage (one listing, one read) and list its committed steps (one
        listing, sent with the lineage's), then the catalog's floor."""
        runstore = location.runstore
        lineage, committed = storage.concurrently(runstore.lineage, runstore.committed_steps)
        floor, online = _floor(location, catalog, lineage, committed)
        attempt_id = uuid.uuid4().hex
        _UNWRITTEN.add(attempt_id)
        return cls(location, catalog, lineage, floor, online, attempt_id, committed)

    def abandon(self) -> None:
        """This registration will never be written (the load stopped first, or the start
        resumes nothing): its attempt id is no longer a claim under way."""
        _UNWRITTEN.discard(self.attempt_id)

    @property
    def lineage(self) -> Lineage:
        """The lineage once this attempt has claimed its epoch, before it decides."""
        epoch = max(self.read.epoch + 1, self.floor)
        claimed = self.read.claim(self.location.storage_run, epoch, attempt_id=self.attempt_id)
        return Lineage(claimed)

    def decide_in_background(
        self, chosen: int | None, choose: Callable[[Lineage], tuple[int | None, Any]]
    ) -> PendingAttempt:
        """Start the claim, the second choice (``choose`` on the claimed lineage) and its
        decision; ``chosen`` is the step the job chose ahead and loads meanwhile."""
        writes = storage.ahead(lambda: self._write(chosen, choose), "zephon-register")
        return PendingAttempt(self, chosen, choose, writes)

    def _write(
        self, chosen: int | None, choose: Callable[[Lineage], tuple[int | None, Any]]
    ) -> Attempt | None:
        """The claim, the choice confirmed, the decision; None if another start claimed
        first."""
        try:
            fence = _claim_at(
                self.location, self.catalog, self.read, self.floor, self.online, self.attempt_id
            )
        except StaleAttemptError:
            return None
        finally:
            _UNWRITTEN.discard(self.attempt_id)
        # Until the claim landed an older attempt could still commit or delete: if the run's
        # committed steps are as they were before the choice, it did neither (a committed step
        # is never rewritten, and retention never deletes the newest), so the choice stands;
        # else choose again, now that it is fenced out.
        step = chosen
        if self.location.runstore.committed_steps() != self.committed:
            step, _ = choose(fence.lineage)
        return decide(self.location, self.catalog, fence, step)


class PendingAttempt:
    """The claim, choice and decision of a ``Registration``, being made."""

    def __init__(
        self,
        registration: Registration,
        chosen: int | None,
        choose: Callable[[Lineage], tuple[int | None, Any]],
        writes: Future,
    ) -> None:
        self.registration = registration
        self.chosen = chosen
        self._choose = choose
        self._writes = writes

    def written(self) -> Attempt | None:
        """The attempt once its writes are done; None if another start claimed first."""
        return self._writes.result()

    def wait(self) -> tuple[Attempt, bool]:
        """The registered attempt, once written, and whether it resumes from the step chosen
        ahead. If another start claimed the epoch first, the attempt registers again on the
        new lineage (``register_resuming``). When the choice did not stand, the job must load
        the attempt's ``resumed_from`` instead, or stop if that is nothing: ``ZephonError``
        then, since the state it loaded cannot be unloaded."""
        attempt = self.written()
        if attempt is None:
            registration = self.registration
            attempt, _ = register_resuming(
                registration.location, registration.catalog, self._choose
            )
        stands = attempt.resumed_from == self.chosen
        if not stands and attempt.resumed_from is None:
            raise ZephonError(
                f"run {self.registration.location.name}: step {self.chosen} left the run's "
                "history while this job loaded it (another start of the run registered), so "
                "the job would start afresh on a loaded state: restart the job"
            )
        return attempt, stands


def register_writer(
    location: RunLocation,
    catalog: Catalog | None,
    *,
    resume_step: int | None = None,
    on_corrupt: Callable[[int, str], None] | None = None,
) -> Attempt:
    """The attempt of a writer that registers at its first save: resuming from
    ``resume_step`` when the job declared it (or loaded it; older history above it is
    abandoned), else continuing the run's latest complete checkpoint, ``implicit``: a save
    below that checkpoint is then refused. ``on_corrupt`` is ``find_latest``'s."""
    from zephon.latest import find_latest  # zephon.latest imports this module

    def choose(lineage: Lineage) -> tuple[int | None, None]:
        if resume_step is not None:
            return resume_step, None
        latest = find_latest(location, catalog=catalog, lineage=lineage, on_corrupt=on_corrupt)
        return (latest.step if latest is not None else None), None

    attempt, _ = register_resuming(location, catalog, choose)
    return attempt if resume_step is not None else dataclasses.replace(attempt, implicit=True)


def mirror_lineage(
    catalog: Catalog, location: RunLocation, lineage: Lineage, *, current: Any = UNREAD
) -> bool:
    """Register in the catalog the attempts storage knows and it does not (attempts that ran
    without this catalog, or a decision it missed), oldest first, so its rows are abandoned as
    storage's lineage says; True if there were any. Costs one read when the catalog is up to
    date (the usual case), none when the caller passes the run's ``current`` attempt record (or
    None) it just read."""
    if not lineage:
        return False
    if lineage.current.attempt_id in _UNWRITTEN:
        # this process's own claim, chosen on before it is written: storage knows no more
        # than the lineage its ``Registration`` read, which was mirrored then
        return False
    if current is UNREAD:
        current = catalog.current_attempt(location.name)
    known = current.epoch if current is not None else 0
    missed_decision = (
        current is not None
        and lineage.epoch == known
        and lineage.current.decided
        and not current.decided
    )
    if lineage.epoch <= known and not missed_decision:
        return False
    for record in location.runstore.attempts():
        with contextlib.suppress(catalog_layer.FencedOutError):
            if record.epoch > known:
                _register_in_catalog(catalog, location.name, record)
            elif record.epoch == known and record.decided and not current.decided:
                catalog.decide_resume(
                    location.name, epoch=record.epoch, resumed_from=record.resumed_from
                )
    return True
