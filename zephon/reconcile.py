"""The one rule that says what a checkpoint is, given what storage holds (marker, condemnation
record), the run's lineage and the catalog's row. ``find_latest``, ``load_latest``, ``gc`` and
``sync`` all ask ``judge`` and act on its verdict, so no two of them can disagree about a step
and none of them can make a restart loop (a step is either history, which resumes, or never
history again until it is saved anew).

=======================================  ==========================  =========================
marker on storage                        catalog row                 verdict
=======================================  ==========================  =========================
absent                                   none, failed, deleted, ...  NOTHING
absent                                   pending                     WAIT (a save in progress)
absent                                   committed                   MISSING (mark deleted)
damaged, or its save condemned           any                         CORRUPT (kept, never used)
epoch or step not in the run's lineage   any                         STALE (never latest)
in the lineage                           stale                       STALE (catalog is stricter)
in the lineage                           deleting                    WAIT (gc finishes it)
in the lineage                           corrupt, same save          CORRUPT
in the lineage                           pending, another save       WAIT (a newer save runs)
in the lineage                           none                        HISTORY (record it)
in the lineage                           same save, pending          HISTORY (crash before the
                                                                     catalog update: promote)
in the lineage                           same save, committed        HISTORY
in the lineage                           same save, failed/deleted   REPAIR (verify deeply,
                                         or another save, not        then promote)
                                         pending
=======================================  ==========================  =========================
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from zephon.catalog import Catalog, CheckpointRecord, SyncOutcome
from zephon.locations import RunLocation
from zephon.storage import CorruptCheckpointError, Lineage, Manifest, concurrently

__all__ = [
    "Examined",
    "Judgement",
    "Probed",
    "Verdict",
    "examine",
    "judge",
    "manifest_facts",
    "probe",
    "quarantine",
    "record_history",
    "repair",
]

_RECORDED = frozenset(
    {SyncOutcome.INSERTED, SyncOutcome.PROMOTED, SyncOutcome.UPDATED, SyncOutcome.UNCHANGED}
)


class Verdict(StrEnum):
    HISTORY = "history"  # a complete checkpoint of the current history
    REPAIR = "repair"  # history by storage, but the row disagrees: verify deeply, then promote
    WAIT = "wait"  # a save or a deletion in progress: leave it to its owner
    MISSING = "missing"  # the row says committed, storage has no marker
    STALE = "stale"  # an abandoned history, an unregistered epoch: gc removes it after grace
    CORRUPT = "corrupt"  # damaged or failed verification: kept until `zephon gc --corrupt`
    NOTHING = "nothing"  # no marker and nothing to do


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    reason: str

    @property
    def usable(self) -> bool:
        """Whether the step may be resumed from (after a repair for REPAIR)."""
        return self.verdict in (Verdict.HISTORY, Verdict.REPAIR)


def judge(
    *,
    lineage: Lineage,
    marker: Manifest | None,
    damaged: str | None = None,
    condemned: bool = False,
    row: CheckpointRecord | None = None,
) -> Judgement:
    """The verdict for one step. ``marker`` is the parsed manifest (None when there is no
    marker, or when it is damaged: then ``damaged`` says why); ``condemned`` is whether a
    ``_CORRUPT`` record names the marker's save; ``row`` the catalog's row, if any."""
    state = row.state if row is not None else None
    if marker is None and damaged is None:
        if state == "pending":
            return Judgement(Verdict.WAIT, "no marker yet: a save in progress")
        if state == "committed":
            return Judgement(Verdict.MISSING, "the row is committed but the marker is gone")
        return Judgement(Verdict.NOTHING, "no marker")
    if marker is None:
        return Judgement(Verdict.CORRUPT, f"damaged marker: {damaged}")
    if condemned:
        return Judgement(Verdict.CORRUPT, f"save {marker.save_id} failed verification")
    why_not = lineage.why_not(marker.epoch, marker.step)
    if why_not is not None:
        return Judgement(Verdict.STALE, why_not)
    if row is None:
        return Judgement(Verdict.HISTORY, "a complete checkpoint the catalog does not know")
    same = row.save_id == marker.save_id
    if state == "stale":
        return Judgement(Verdict.STALE, row.failure_reason or "the catalog abandoned it")
    if state == "deleting":
        return Judgement(Verdict.WAIT, "gc is deleting it")
    if state == "corrupt" and same:
        return Judgement(Verdict.CORRUPT, row.failure_reason or "failed verification")
    if state == "pending" and not same:
        return Judgement(Verdict.WAIT, f"save {row.save_id} of this step is in progress")
    if same and state in ("pending", "committed"):
        return Judgement(Verdict.HISTORY, "complete")
    return Judgement(
        Verdict.REPAIR,
        f"the marker of save {marker.save_id} is complete but the row says {state}"
        + ("" if same else f" for save {row.save_id}"),
    )


def manifest_facts(manifest: Manifest) -> dict[str, Any]:
    """The catalog's facts about a committed checkpoint, from its manifest: the one place
    that turns a manifest into row values (save path, resume probe, gc and sync use it)."""
    return {
        "bytes": manifest.total_bytes,
        "file_count": manifest.file_count,
        "manifest_checksum": manifest.checksum(),
        "metadata": manifest.metadata or None,
        "stored_bytes": manifest.new_bytes if manifest.chunked else None,
    }


# -- acting on a verdict -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Examined:
    """What storage holds at one step, and the verdict for it."""

    step: int
    manifest: Manifest | None
    judgement: Judgement


@dataclass(frozen=True, slots=True)
class Probed:
    """What storage holds at one step: the parsed marker (None when absent or damaged), why
    it is damaged, and whether a ``_CORRUPT`` record condemns the marker's save."""

    manifest: Manifest | None
    damaged: str | None
    condemned: bool


def probe(
    location: RunLocation,
    step: int,
    *,
    save_id: str | None = None,
    condemned: frozenset[str] | None = None,
    also: Sequence[Callable[[], Any]] = (),
) -> tuple[Probed, list[Any]]:
    """Read the step's marker and whether its save is condemned, in one round trip when the
    save is known in advance (``save_id``, e.g. the catalog row's: the condemnation check goes
    out with the GET; a marker of another save costs one more request) or a listing already
    said (``condemned``). ``also``: more independent requests sent at the same time; their
    results are returned in order."""
    store, storage_run = location.store, location.storage_run
    calls: list[Callable[[], Any]] = [functools.partial(store.run(storage_run).marker_bytes, step)]
    if condemned is None and save_id is not None:
        calls.append(functools.partial(store.run(storage_run).is_condemned, step, save_id))
    results = concurrently(*calls, *also)
    data, extra = results[0], results[len(calls) :]
    manifest, damaged = None, None
    if data is not None:
        try:
            manifest = store.run(storage_run).parse_marker(step, data)
        except CorruptCheckpointError as exc:
            damaged = "; ".join(exc.problems[:1]) or str(exc)
    is_condemned = False
    if manifest is not None:
        if condemned is not None:
            is_condemned = manifest.save_id in condemned
        elif save_id is not None and manifest.save_id == save_id:
            is_condemned = bool(results[1])
        else:
            is_condemned = store.run(storage_run).is_condemned(step, manifest.save_id)
    return Probed(manifest, damaged, is_condemned), extra


def examine(
    location: RunLocation,
    lineage: Lineage,
    step: int,
    row: CheckpointRecord | None = None,
    *,
    condemned: frozenset[str] | None = None,
) -> Examined:
    """Read the step's marker and whether its save is condemned (``probe``: one round trip
    with a row, whose save is the one to ask about, or a listing that already said:
    ``condemned``), and judge it."""
    seen, _ = probe(
        location, step, save_id=row.save_id if row is not None else None, condemned=condemned
    )
    verdict = judge(
        lineage=lineage,
        marker=seen.manifest,
        damaged=seen.damaged,
        condemned=seen.condemned,
        row=row,
    )
    return Examined(step, seen.manifest, verdict)


def record_history(catalog: Catalog, location: RunLocation, manifest: Manifest) -> SyncOutcome:
    """Make the catalog say what storage says: the complete checkpoint ``manifest`` is
    committed (insert, promote or update its row). The catalog refuses it (``STALE``) if its
    own lineage abandoned that epoch and step."""
    _, outcome = catalog.upsert_committed(
        location.name,
        manifest.step,
        location.checkpoint_url(manifest.step),
        save_id=manifest.save_id,
        epoch=manifest.epoch,
        committed_at=_parse_time(manifest.committed_at),
        **manifest_facts(manifest),
    )
    return outcome


def quarantine(
    catalog: Catalog | None,
    location: RunLocation,
    step: int,
    reason: str,
    *,
    manifest: Manifest | None = None,
    save_id: str | None = None,
) -> None:
    """Mark a save that failed verification: a ``_CORRUPT`` record beside it on storage (so
    a catalog rebuilt from storage knows too; a damaged marker needs none, it is corrupt by
    itself), and its row ``corrupt``. Nothing is deleted."""
    if manifest is not None:
        location.runstore.condemn(step, manifest, reason)
        save_id = manifest.save_id
    if catalog is not None and save_id is not None:
        catalog.mark_corrupt(location.name, step, save_id, reason[:2000])


def repair(catalog: Catalog, location: RunLocation, examined: Examined) -> bool:
    """A REPAIR verdict: verify every byte of the checkpoint, then record it as committed;
    one that fails verification is quarantined. True if it is history now."""
    manifest = examined.manifest
    assert manifest is not None
    report = location.runstore.verify(examined.step, deep=True)
    if not report.ok:
        reason = "; ".join(str(p) for p in report.problems[:5])
        why = f"verification failed: {reason}"
        quarantine(catalog, location, examined.step, why, manifest=manifest)
        return False
    return record_history(catalog, location, manifest) in _RECORDED


def _parse_time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
