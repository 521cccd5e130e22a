"""Finding the latest complete checkpoint of a run: with a catalog, one indexed query plus a
probe of the few rows above it; without one, a storage scan. Both judge every step by the one
rule of ``zephon.reconcile``: a checkpoint of an abandoned history, an unregistered attempt or
a condemned save is never latest, whatever its marker says.

With a catalog the answer is the catalog's newest committed row, and what storage must still
say about it is checked where its marker is read anyway (docs/fencing.md, "What latest trusts
the catalog for"): by ``find_latest`` itself with ``confirm`` (a job start, which records the
step as its resume point, or ``zephon.dcp.Reader``, which then opens the checkpoint with that
marker), else when ``LatestCheckpoint.manifest`` is first read. The check is one round trip of
independent requests: the marker (compared with the row's save and manifest checksum), the
save's ``_CORRUPT`` record and, unless the caller read the lineage, a listing of the run's
attempts (storage may know an attempt the catalog missed). A row that fails it is reconciled
(marked deleted, corrupt or stale) and never answered again, so no restart loop can follow.

Storage is touched only where the answer needs it: an answer the catalog gives alone opens no
store (its URL is the row's ``path``), and the modules that judge markers (``zephon.reconcile``,
the storage layer's lineage and backends) are imported when a marker is first read, so
``zephon latest`` on a catalog loads no filesystem package.

A catalog that cannot be reached is no reason to stop: the lookup falls back to the storage
scan, the source of truth, and logs one warning (``zephon.outage`` counts the outage).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zephon.catalog import PROBED_STATES, CatalogUnavailableError, RunNotFoundError
from zephon.errors import ZephonError
from zephon.storage import CheckpointNotFoundError

if TYPE_CHECKING:
    from zephon.catalog import Catalog, CheckpointRecord
    from zephon.locations import RunLocation
    from zephon.reconcile import Examined
    from zephon.storage import Lineage, Manifest

__all__ = ["LatestCheckpoint", "find_latest"]

log = logging.getLogger("zephon")

#: committed rows find_latest may set aside (missing, corrupt, stale) before it gives up
_MAX_SET_ASIDE = 1000


@dataclass(frozen=True, slots=True, eq=False)
class LatestCheckpoint:
    """The newest complete checkpoint: its step, URL, manifest and how it was found.

    ``manifest`` may be lazy: an answer the catalog gave without reading storage
    (``find_latest`` without ``confirm``) reads and checks its marker when ``manifest`` is
    first read (one round trip). If storage does not bear the row out (the marker vanished,
    names another save or an abandoned history, its save was condemned), the row is
    reconciled so no later lookup answers it again, and ``manifest`` raises
    ``storage.CheckpointNotFoundError`` naming the step: look the latest up again.
    ``confirmed`` says whether the marker was read and judged already.
    """

    step: int
    url: str
    source: str  # "catalog" or "storage"
    #: steps whose rows were promoted or repaired because their marker was complete
    promoted: tuple[int, ...] = field(default=())
    #: steps whose committed rows lost their marker and were marked deleted
    missing: tuple[int, ...] = field(default=())
    #: steps set aside on the way: (step, why) for corrupt or abandoned ones
    set_aside: tuple[tuple[int, str], ...] = field(default=())
    #: the catalog row's save (None from a storage scan: the manifest says)
    save_id: str | None = None
    _manifest: list[Manifest] = field(default_factory=list, repr=False)
    _check: Callable[[], Manifest] | None = field(default=None, repr=False)

    @property
    def confirmed(self) -> bool:
        """Whether the marker was read and judged (``manifest`` costs nothing more)."""
        return bool(self._manifest)

    @property
    def manifest(self) -> Manifest:
        """The checkpoint's manifest, read from its marker and checked on first use if the
        catalog's answer was taken without reading storage (see the class docstring)."""
        if not self._manifest:
            assert self._check is not None
            self._manifest.append(self._check())
        return self._manifest[0]


def find_latest(
    location: RunLocation,
    *,
    catalog: Catalog | None = None,
    lineage: Lineage | None = None,
    on_corrupt: Callable[[int, str], None] | None = None,
    confirm: bool | None = None,
) -> LatestCheckpoint | None:
    """The latest complete checkpoint of the run, or None if it has none.

    ``lineage`` is the run's lineage if the caller already read it. With a catalog: the newest
    committed row (one indexed query), after probing the rows above it (pending, failed,
    deleted: normally none) for a complete marker of the current history, which is promoted
    (a crash between marker and catalog update) or, for a failed or deleted row, verified
    deeply and then promoted. A run unknown to the catalog, or a catalog that cannot be
    reached (one warning is logged), falls back to the storage scan.

    ``confirm`` (default: when ``lineage`` is given, i.e. for a job start that records the
    answer as its resume point): read and judge the row's marker before answering (one round
    trip); a committed row whose marker is gone is marked deleted, a corrupt one quarantined,
    an abandoned one staled, and the next one tried. Without it the catalog's row is the
    answer, with no storage request in the common case, and ``manifest`` does that check when
    first read (``LatestCheckpoint``): callers that load the step must read ``manifest`` (or
    confirm) first, so a row storage does not bear out is set aside instead of loaded again.
    ``on_corrupt(step, why)`` is told of every checkpoint found damaged on the way, before it
    is quarantined (it may raise to stop there).
    """
    if catalog is not None:
        from zephon.outage import guard

        try:
            confirming = lineage is not None if confirm is None else confirm
            return guard(catalog).call(
                lambda: _Rule(location, catalog, lineage, on_corrupt or _ignore).latest(confirming),
                retry_s=0,
            )
        except RunNotFoundError:
            pass
        except CatalogUnavailableError as exc:
            log.warning(
                "zephon: run %s: %s; finding its latest checkpoint by a storage scan",
                location.name,
                exc,
            )
    manifest = location.runstore.latest(lineage=lineage, on_corrupt=on_corrupt)
    if manifest is None:
        return None
    return LatestCheckpoint(
        manifest.step,
        location.checkpoint_url(manifest.step),
        "storage",
        save_id=manifest.save_id,
        _manifest=[manifest],
    )


def _ignore(step: int, why: str) -> None:
    pass


class _Rule:
    """One lookup through the catalog: the lineage it judges by (the caller's, the catalog's
    when it is up to date, or storage's, read at most once and mirrored into the catalog),
    and what it did on the way."""

    def __init__(
        self,
        location: RunLocation,
        catalog: Catalog,
        lineage: Lineage | None,
        on_corrupt: Callable[[int, str], None],
    ) -> None:
        self.location, self.catalog, self.on_corrupt = location, catalog, on_corrupt
        self.name = location.name
        self._lineage = lineage
        self.promoted: list[int] = []
        self.missing: list[int] = []
        self.set_aside: list[tuple[int, str]] = []
        #: why the last row ``settle`` looked at was not borne out
        self.why = ""
        if lineage is not None:
            from zephon.attempts import mirror_lineage

            mirror_lineage(catalog, location, lineage)  # costs nothing when up to date
            self.known_epoch = lineage.epoch
        else:
            current = catalog.current_attempt(self.name)
            if current is None or not current.decided:
                self.lineage()  # no fenced attempt yet, or one deciding now: ask storage
            self.known_epoch = current.epoch if current is not None else 0

    def lineage(self) -> Lineage:
        """Storage's lineage (the caller's if given), mirrored into the catalog."""
        if self._lineage is None:
            from zephon.attempts import mirror_lineage

            self._lineage = self.location.runstore.lineage()
            mirror_lineage(self.catalog, self.location, self._lineage)
        return self._lineage

    def found(
        self, step: int, save_id: str, manifest: Manifest | None, url: str | None = None
    ) -> LatestCheckpoint:
        """The answer; ``url``: the row's, when the answer was taken from the catalog alone
        (so the store is not opened for it)."""
        return LatestCheckpoint(
            step,
            url or self.location.checkpoint_url(step),
            "catalog",
            tuple(self.promoted),
            tuple(self.missing),
            tuple(self.set_aside),
            save_id=manifest.save_id if manifest is not None else save_id,
            _manifest=[manifest] if manifest is not None else [],
        )

    def latest(self, confirm: bool) -> LatestCheckpoint | None:
        catalog, name = self.catalog, self.name
        while len(self.missing) + len(self.set_aside) <= _MAX_SET_ASIDE:
            newest = catalog.latest_committed(name)
            above = newest.step if newest is not None else None
            for row in catalog.rows_after(name, above, states=PROBED_STATES):
                manifest = self.probe_above(row)
                if manifest is not None:
                    self.promoted.append(row.step)
                    return self.found(row.step, row.save_id, manifest)
            if newest is None:
                return None
            if not confirm:
                answer = self.found(newest.step, newest.save_id, None, url=newest.path)
                check = functools.partial(self.resolve, newest)
                object.__setattr__(answer, "_check", check)
                return answer
            manifest = self.settle(newest)
            if manifest is not None:
                return self.found(newest.step, newest.save_id, manifest)
        raise ZephonError(
            f"run {name}: {_MAX_SET_ASIDE} checkpoints were set aside (missing, corrupt or "
            "abandoned) looking for the latest; run `zephon sync` to bring the catalog up to "
            "date with storage"
        )

    def probe_above(self, row: CheckpointRecord) -> Manifest | None:
        """A pending, failed or deleted row above the newest committed one: its complete marker
        of the current history is promoted (repaired first if the row disagrees)."""
        from zephon.reconcile import (
            Examined,
            Verdict,
            judge,
            probe,
            quarantine,
            record_history,
            repair,
        )

        lineage = self.lineage()
        seen, _ = probe(self.location, row.step, save_id=row.save_id)
        judgement = judge(
            lineage=lineage,
            marker=seen.manifest,
            damaged=seen.damaged,
            condemned=seen.condemned,
            row=row,
        )
        examined = Examined(row.step, seen.manifest, judgement)
        verdict = judgement.verdict
        if verdict is Verdict.HISTORY and seen.manifest is not None:
            if record_history(self.catalog, self.location, seen.manifest).value != "stale":
                return seen.manifest
        elif verdict is Verdict.REPAIR and repair(self.catalog, self.location, examined):
            return seen.manifest
        elif verdict is Verdict.CORRUPT and seen.manifest is not None:
            # (a damaged marker above a pending row may be a live save's to supersede)
            self.on_corrupt(row.step, judgement.reason)
            quarantine(
                self.catalog, self.location, row.step, judgement.reason, manifest=seen.manifest
            )
        return None

    def settle(self, row: CheckpointRecord) -> Manifest | None:
        """Check a committed row against storage (one round trip): its manifest if storage
        bears it out (or it was repaired); else the row is reconciled, ``self.why`` says why,
        and None is returned."""
        from zephon.reconcile import Verdict, quarantine, repair

        examined = self.examine(row)
        verdict, reason = examined.judgement.verdict, examined.judgement.reason
        self.why = reason
        if verdict is Verdict.HISTORY and examined.manifest is not None:
            return examined.manifest
        if verdict is Verdict.REPAIR and repair(self.catalog, self.location, examined):
            return examined.manifest
        if verdict is Verdict.MISSING:
            self.catalog.mark_missing(self.name, row.step)
            self.missing.append(row.step)
            return None
        self.set_aside.append((row.step, reason))
        if verdict is Verdict.CORRUPT:
            self.on_corrupt(row.step, reason)
            quarantine(
                self.catalog,
                self.location,
                row.step,
                reason,
                manifest=examined.manifest,
                save_id=row.save_id,
            )
        else:
            self.catalog.mark_stale(self.name, row.step, row.save_id, reason)
        return None

    def examine(self, row: CheckpointRecord) -> Examined:
        """The verdict for a committed row: its marker, its save's condemnation and (when the
        lineage is the catalog's) whether storage knows a newer attempt, all at once."""
        from zephon.reconcile import Examined, Judgement, Verdict, judge, probe
        from zephon.storage import newer_epochs

        location = self.location
        store, storage_run = location.store, location.storage_run
        also = []
        if self._lineage is None:
            run_path = store.run(storage_run).run_path()
            also.append(functools.partial(newer_epochs, store.location, run_path, self.known_epoch))
        seen, extra = probe(location, row.step, save_id=row.save_id, also=also)
        current = row
        if extra and extra[0] is not None:
            self.lineage()  # an attempt the catalog missed: mirrored (it may stale this row)
            current = self.catalog.get_checkpoint(self.name, row.step)
        manifest = seen.manifest
        bears_out = (
            manifest is not None
            and manifest.save_id == row.save_id
            and manifest.epoch == row.epoch
            and (row.manifest_checksum is None or manifest.checksum() == row.manifest_checksum)
        )
        if self._lineage is None and bears_out and not seen.condemned:
            # The catalog is up to date with storage's attempts, and its committed rows are
            # already judged by them (a decision stales what it abandons, in one transaction).
            return Examined(row.step, manifest, Judgement(Verdict.HISTORY, "complete"))
        judgement = judge(
            lineage=self.lineage(),
            marker=manifest,
            damaged=seen.damaged,
            condemned=seen.condemned,
            row=current,
        )
        if judgement.verdict is Verdict.HISTORY and not bears_out:
            # the same save, but the marker is not the one the row recorded
            judgement = Judgement(
                Verdict.REPAIR, "the marker differs from the one the catalog recorded"
            )
        return Examined(row.step, manifest, judgement)

    def resolve(self, row: CheckpointRecord) -> Manifest:
        """``LatestCheckpoint.manifest`` of an answer taken from the catalog alone."""
        manifest = self.settle(row)
        if manifest is not None:
            return manifest
        url = self.location.checkpoint_url(row.step)
        why = self.why
        raise CheckpointNotFoundError(
            f"{url}, the catalog's latest checkpoint, is not one to resume from ({why}); it was "
            "set aside: look the latest checkpoint up again",
            url=url,
            run=self.location.storage_run,
            step=row.step,
        )
