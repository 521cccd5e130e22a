"""Finding the latest complete checkpoint of a run: with a catalog, one indexed query plus a
probe of the few rows above it; without one, a storage scan. Both judge every step by the one
rule of ``zephon.reconcile``: a checkpoint of an abandoned history, an unregistered attempt or
a condemned save is never latest, whatever its marker says."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from catalog import Catalog, RunNotFoundError
from storage import Lineage, Manifest
from zephon.attempts import mirror_lineage
from zephon.errors import ZephonError
from zephon.locations import RunLocation
from zephon.reconcile import Verdict, examine, quarantine, record_history, repair

__all__ = ["LatestCheckpoint", "find_latest"]

#: rows whose marker the probe above the newest committed one looks at
_PROBED_STATES = ("pending", "failed", "deleted")
#: committed rows find_latest may set aside (missing, corrupt, stale) before it gives up
_MAX_SET_ASIDE = 1000


@dataclass(frozen=True, slots=True)
class LatestCheckpoint:
    """The newest complete checkpoint: its step, URL, manifest and how it was found."""

    step: int
    url: str
    manifest: Manifest
    source: str  # "catalog" or "storage"
    #: steps whose rows were promoted or repaired because their marker was complete
    promoted: tuple[int, ...] = field(default=())
    #: steps whose committed rows lost their marker and were marked deleted
    missing: tuple[int, ...] = field(default=())
    #: steps set aside on the way: (step, why) for corrupt or abandoned ones
    set_aside: tuple[tuple[int, str], ...] = field(default=())


def find_latest(
    location: RunLocation,
    *,
    catalog: Catalog | None = None,
    lineage: Lineage | None = None,
    on_corrupt: Callable[[int, str], None] | None = None,
) -> LatestCheckpoint | None:
    """The latest complete checkpoint of the run, or None if it has none.

    ``lineage`` is the run's lineage if the caller already read it (one listing and one GET
    otherwise). With a catalog: the newest committed row (one indexed query), after probing
    the rows above it (pending, failed, deleted: normally none or one) for a complete marker
    of the current history, which is promoted (a crash between marker and catalog update) or,
    for a failed or deleted row, verified deeply and then promoted. A committed row whose
    marker is gone is marked deleted, a corrupt one quarantined, an abandoned one staled, and
    the next one tried. A run unknown to the catalog falls back to the storage scan.
    ``on_corrupt(step, why)`` is told of every checkpoint found damaged on the way, before it
    is quarantined (it may raise to stop there).
    """
    store, storage_run = location.store, location.storage_run
    lineage = lineage if lineage is not None else store.lineage(storage_run)
    if catalog is not None:
        try:
            return _from_catalog(location, catalog, lineage, on_corrupt or _ignore)
        except RunNotFoundError:
            pass
    manifest = store.latest(storage_run, lineage=lineage, on_corrupt=on_corrupt)
    if manifest is None:
        return None
    return LatestCheckpoint(
        manifest.step, location.checkpoint_url(manifest.step), manifest, "storage"
    )


def _ignore(step: int, why: str) -> None:
    pass


def _from_catalog(
    location: RunLocation,
    catalog: Catalog,
    lineage: Lineage,
    on_corrupt: Callable[[int, str], None],
) -> LatestCheckpoint | None:
    name = location.name
    mirror_lineage(catalog, location, lineage)
    promoted: list[int] = []
    missing: list[int] = []
    set_aside: list[tuple[int, str]] = []

    def found(step: int, manifest: Manifest) -> LatestCheckpoint:
        return LatestCheckpoint(
            step,
            location.checkpoint_url(step),
            manifest,
            "catalog",
            tuple(promoted),
            tuple(missing),
            tuple(set_aside),
        )

    while len(missing) + len(set_aside) <= _MAX_SET_ASIDE:
        newest = catalog.latest_committed(name)
        above = newest.step if newest is not None else None
        for row in catalog.rows_after(name, above, states=_PROBED_STATES):
            seen = examine(location, lineage, row.step, row)
            verdict = seen.judgement.verdict
            if verdict is Verdict.HISTORY and seen.manifest is not None:
                if record_history(catalog, location, seen.manifest).value != "stale":
                    promoted.append(row.step)
                    return found(row.step, seen.manifest)
            elif verdict is Verdict.REPAIR and repair(catalog, location, seen):
                promoted.append(row.step)
                assert seen.manifest is not None
                return found(row.step, seen.manifest)
            elif verdict is Verdict.CORRUPT and seen.manifest is not None:
                # (a damaged marker above a pending row may be a live save's to supersede)
                on_corrupt(row.step, seen.judgement.reason)
                quarantine(
                    catalog, location, row.step, seen.judgement.reason, manifest=seen.manifest
                )
        if newest is None:
            return None
        seen = examine(location, lineage, newest.step, newest)
        verdict = seen.judgement.verdict
        if verdict is Verdict.HISTORY and seen.manifest is not None:
            return found(newest.step, seen.manifest)
        if verdict is Verdict.REPAIR and repair(catalog, location, seen):
            assert seen.manifest is not None
            return found(newest.step, seen.manifest)
        if verdict is Verdict.MISSING:
            catalog.mark_missing(name, newest.step)
            missing.append(newest.step)
            continue
        set_aside.append((newest.step, seen.judgement.reason))
        if verdict is Verdict.CORRUPT:
            on_corrupt(newest.step, seen.judgement.reason)
            quarantine(
                catalog,
                location,
                newest.step,
                seen.judgement.reason,
                manifest=seen.manifest,
                save_id=newest.save_id,
            )
        else:
            catalog.mark_stale(name, newest.step, newest.save_id, seen.judgement.reason)
    raise ZephonError(
        f"run {name}: {_MAX_SET_ASIDE} checkpoints were set aside (missing, corrupt or abandoned) "
        "looking for the latest; run `zephon sync` to bring the catalog up to date with storage"
    )
