"""Retention and garbage collection: apply each run's policy, finish interrupted deletes,
settle stale pending rows, and remove orphaned uncommitted directories.

Safe to run in several processes at once and beside saving jobs: deletions go through the
catalog's claims (a row is deleted by exactly one claimant), stale pending rows are settled
with guarded transitions, and a crash at any point is finished by the next run.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from catalog import (
    DEFAULT_GRACE,
    DEFAULT_LEASE,
    Catalog,
    CatalogError,
    StateConflictError,
    plan_retention,
)
from storage import CheckpointNotFoundError, CheckpointStore, CorruptCheckpointError, StorageError
from zephon.latest import record_commit
from zephon.locations import RunLocation, run_location

__all__ = ["GcReport", "collect_garbage", "gc_run", "retain_without_catalog"]


@dataclass
class GcReport:
    """What one gc pass did (or, with ``dry_run``, would do)."""

    dry_run: bool
    deleted: list[dict[str, Any]] = field(default_factory=list)
    settled: list[dict[str, Any]] = field(default_factory=list)
    orphans: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "deleted": self.deleted,
            "settled": self.settled,
            "orphans": self.orphans,
            "problems": self.problems,
        }


def collect_garbage(
    catalog: Catalog,
    *,
    runs: Iterable[str] | None = None,
    grace: dt.timedelta = DEFAULT_GRACE,
    lease: dt.timedelta = DEFAULT_LEASE,
    dry_run: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> GcReport:
    """One gc pass over the given runs (default: every run in the catalog).

    A problem with one run is recorded in the report and the other runs still processed.
    """
    report = GcReport(dry_run=dry_run)
    if runs is None:
        records = [summary.run for summary in catalog.list_runs()]
    else:
        records = []
        for name in runs:
            records.append(catalog.get_run(name))
    for record in records:
        progress(record.name)
        try:
            location = run_location(record, storage_options)
            gc_run(catalog, location, grace=grace, lease=lease, dry_run=dry_run, report=report)
        except (CatalogError, StorageError) as exc:
            report.problems.append(f"run {record.name}: {exc}")
    return report


def gc_run(
    catalog: Catalog,
    location: RunLocation,
    *,
    grace: dt.timedelta = DEFAULT_GRACE,
    lease: dt.timedelta = DEFAULT_LEASE,
    dry_run: bool = False,
    orphans: bool = True,
    report: GcReport | None = None,
) -> GcReport:
    """Apply one run's retention policy: settle stale pending rows, delete what the policy no
    longer keeps (and what a crashed gc left half-deleted), then remove orphaned directories.

    The checkpoint manager calls this on the main process after each save.
    """
    report = report or GcReport(dry_run=dry_run)
    name, store, storage_run = location.name, location.store, location.storage_run
    plan = catalog.retention_plan(name, grace=grace)

    for decision in plan.to_expire:
        _settle_stale_pending(catalog, location, decision, dry_run, report)

    stuck = [row.step for row in catalog.expired_claims(run=name, lease=lease)]
    candidates = sorted(set(plan.to_delete) | set(stuck))
    if dry_run:
        for step in candidates:
            report.deleted.append({"run": name, "step": step, "files": None})
    elif candidates:
        claimed = catalog.claim_for_deletion(name, candidates, lease=lease)
        # One batched delete for all claimed checkpoints: every marker first, then payloads.
        removed = store.delete_many(storage_run, [row.step for row in claimed])
        for row in claimed:
            catalog.mark_deleted(name, row.step, row.claimed_by)
            report.deleted.append({"run": name, "step": row.step, "files": removed[row.step]})

    if orphans:
        _remove_orphans(catalog, location, grace, dry_run, report)
    return report


def _settle_stale_pending(catalog, location: RunLocation, decision, dry_run, report) -> None:
    """A pending row older than the grace period: its writer most likely crashed. If the marker
    exists the checkpoint is complete (crash after commit) and is promoted; otherwise failed."""
    store, storage_run = location.store, location.storage_run
    try:
        manifest = store.read_manifest(storage_run, decision.step)
    except (CheckpointNotFoundError, CorruptCheckpointError):
        manifest = None
    outcome = "committed" if manifest is not None else "failed"
    report.settled.append({"run": location.name, "step": decision.step, "to": outcome})
    if dry_run:
        return
    try:
        if manifest is not None:
            row = catalog.get_checkpoint(location.name, decision.step)
            if row.save_id == decision.save_id:
                record_commit(catalog, location.name, row, manifest)
        else:
            catalog.mark_failed(
                location.name,
                decision.step,
                decision.save_id,
                "no commit marker after the grace period: the writer did not finish",
            )
    except StateConflictError:
        report.settled.pop()  # the writer or another gc moved it first


def _remove_orphans(catalog, location: RunLocation, grace, dry_run, report) -> None:
    store, storage_run, name = location.store, location.storage_run, location.name
    rows = {row.step: row for row in catalog.list_checkpoints(name)}
    for orphan in store.orphans(grace.total_seconds(), runs=[storage_run]):
        row = rows.get(orphan.step)
        if row is not None and row.state in {"pending", "committed", "deleting"}:
            # pending: a writer within its grace period (or settled above next time);
            # committed without a marker: sync's business; deleting: the claim finishes it.
            continue
        report.orphans.append({"run": name, "step": orphan.step, "url": orphan.url})
        if not dry_run:
            store.delete(storage_run, orphan.step)
            catalog.record_event(
                "orphan_removed", run=name, step=orphan.step, detail={"url": orphan.url}
            )


@dataclass(frozen=True, slots=True)
class _StorageRow:
    """A committed step seen on storage, in the shape retention planning reads."""

    step: int
    state: str = "committed"
    pinned: bool = False
    created_at: dt.datetime = dt.datetime.fromtimestamp(0, dt.UTC)
    save_id: str = ""


def retain_without_catalog(
    store: CheckpointStore,
    storage_run: str | None,
    num_to_keep: int | None,
    keep_every_steps: int | None = None,
) -> list[int]:
    """Retention for a job running without a catalog: keep the ``num_to_keep`` newest committed
    steps (and milestones), delete the others. Returns the deleted steps. Pins live in the
    catalog, so none apply here."""
    rows = [_StorageRow(step) for step in store.committed_steps(storage_run)]
    plan = plan_retention(
        rows, num_to_keep, keep_every_steps, dt.datetime.now(dt.UTC), DEFAULT_GRACE
    )
    for step in plan.to_delete:
        store.delete(storage_run, step)
    return plan.to_delete
