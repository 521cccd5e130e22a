"""``zephon sync``: index what a storage URL holds into the catalog, so a catalog can be
rebuilt or repaired from storage (the source of truth) at any time."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zephon.attempts import mirror_lineage
from zephon.catalog import Catalog, CatalogError, RunKind, SyncOutcome
from zephon.locations import RunLocation, inference_run_name
from zephon.reconcile import Verdict, examine, quarantine, record_history, repair
from zephon.storage import CheckpointStore, RetryPolicy, StorageError

__all__ = ["SyncReport", "sync_storage"]


@dataclass
class SyncReport:
    url: str
    runs: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    marked_missing: list[tuple[str, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "runs": self.runs,
            "outcomes": self.outcomes,
            "marked_missing": [{"run": r, "step": s} for r, s in self.marked_missing],
            "problems": self.problems,
        }


def sync_storage(
    catalog: Catalog,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    inference_name: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
    retry: RetryPolicy | None = None,
) -> SyncReport:
    """Import every run, attempt and checkpoint under ``url``, judged by the one rule of
    ``zephon.reconcile``: history is recorded (a row that says failed or deleted is repaired
    after a deep verification), an abandoned or unregistered marker is never promoted (its row
    is staled), a condemned or damaged one is recorded corrupt; rows whose marker is gone are
    marked deleted. Idempotent. Reads one listing per run and every marker.

    Problems with one run (a name registered elsewhere, an unreadable marker) are reported and
    the others still synced.
    """
    store = CheckpointStore(url, storage_options, retry=retry)
    root = store.location.canonical_url
    report = SyncReport(root)
    targets: list[tuple[str, str | None, str]] = [(r, r, RunKind.TRAIN) for r in store.runs()]
    if store.has_inference_layout():
        targets.append((inference_name or inference_run_name(root), None, RunKind.INFERENCE))
    for name, storage_run, kind in targets:
        progress(name)
        try:
            _sync_run(catalog, store, root, name, storage_run, kind, report)
        except (CatalogError, StorageError) as exc:
            report.problems.append(f"run {name}: {exc}")
    return report


def _indexed(row, listing, lineage) -> bool:
    """Whether the catalog already records this committed step as storage holds it, without
    reading its marker: its only payload directory is the committed row's save (or, format 1,
    it has none), not condemned, and the row's epoch and step are in the lineage."""
    if row is None or row.state != "committed" or row.save_id in listing.condemned:
        return False
    only_save = set(listing.saves) == {row.save_id} or (not listing.saves and row.epoch == 0)
    return only_save and lineage.admits(row.epoch, row.step)


def _sync_run(
    catalog: Catalog,
    store: CheckpointStore,
    root: str,
    name: str,
    storage_run: str | None,
    kind: str,
    report: SyncReport,
) -> None:
    if not store.run(storage_run).list_steps():
        return
    catalog.ensure_run(name, root, kind=kind)
    report.runs.append(name)
    reconcile_run(catalog, RunLocation(name, store, storage_run), report)


def reconcile_run(
    catalog: Catalog, location: RunLocation, report: SyncReport, *, pending: bool = True
) -> None:
    """Make one catalog run say what its storage says, step by step, by the one rule: what
    ``sync`` does for each run, and gc for the runs it collects (so a marker the catalog never
    heard of, e.g. an attempt's that ran without it, gets a row: history is recorded, an
    abandoned one is recorded ``stale`` and deleted after the grace). ``pending=False`` leaves
    pending rows to their writer (gc settles them only after the pending grace)."""
    store, storage_run, name = location.store, location.storage_run, location.name
    lineage = store.run(storage_run).lineage()
    mirror_lineage(catalog, location, lineage)
    # Rows before the listing: a row committed before the listing has its marker in it (the
    # marker comes first), so "committed but no marker" is never a save that just finished.
    rows = {row.step: row for row in catalog.list_checkpoints(name)}
    steps = store.run(storage_run).list_steps(detail=True)
    committed_on_storage = {s.step for s in steps if s.committed}
    for listing in steps:
        if not listing.committed:
            continue
        row = rows.get(listing.step)
        if not pending and row is not None and row.state == "pending":
            continue
        if _indexed(row, listing, lineage):
            report.count(SyncOutcome.UNCHANGED.value)
            continue
        seen = examine(location, lineage, listing.step, row, condemned=listing.condemned)
        verdict = seen.judgement.verdict
        if verdict is Verdict.HISTORY and seen.manifest is not None:
            if row is not None and row.state == "committed":
                report.count(SyncOutcome.UNCHANGED.value)
                continue
            report.count(record_history(catalog, location, seen.manifest).value)
        elif verdict is Verdict.REPAIR:
            report.count("repaired" if repair(catalog, location, seen) else "corrupt")
        elif verdict is Verdict.CORRUPT:
            if seen.manifest is not None:
                quarantine(
                    catalog, location, listing.step, seen.judgement.reason, manifest=seen.manifest
                )
            report.count("corrupt")
            report.problems.append(f"run {name} step {listing.step}: {seen.judgement.reason}")
        elif verdict is Verdict.STALE:
            marker = seen.manifest
            same = row is not None and marker is not None and row.save_id == marker.save_id
            if same and row.state in ("pending", "committed", "failed"):
                catalog.mark_stale(name, listing.step, row.save_id, seen.judgement.reason)
            elif row is None and marker is not None:
                record_history(catalog, location, marker)  # the catalog records it stale
            report.count("stale")
        else:
            report.count(verdict.value)
    for step, row in rows.items():
        missing = row.state == "committed" and step not in committed_on_storage
        if missing and catalog.mark_missing(name, step):
            report.marked_missing.append((name, step))
