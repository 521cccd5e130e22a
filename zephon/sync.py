"""``zephon sync``: index what a storage URL holds into the catalog, so a catalog can be
rebuilt or repaired from storage (the source of truth) at any time."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from catalog import Catalog, CatalogError, RunKind, SyncOutcome
from storage import CheckpointStore, CorruptCheckpointError, StorageError
from zephon.locations import inference_run_name

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


def _parse_time(text: str) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None


def sync_storage(
    catalog: Catalog,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    inference_name: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> SyncReport:
    """Import every run and committed checkpoint under ``url``; mark catalog rows whose marker
    is gone. Idempotent. Reads one listing per run and each marker not yet indexed.

    Problems with one run (a name registered elsewhere, an unreadable marker) are reported and
    the others still synced.
    """
    store = CheckpointStore(url, storage_options)
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


def _sync_run(
    catalog: Catalog,
    store: CheckpointStore,
    root: str,
    name: str,
    storage_run: str | None,
    kind: str,
    report: SyncReport,
) -> None:
    steps = store.list_steps(storage_run)
    committed_on_storage = {s.step for s in steps if s.committed}
    if not steps:
        return
    catalog.ensure_run(name, root, kind=kind)
    report.runs.append(name)
    rows = {row.step: row for row in catalog.list_checkpoints(name)}
    for step in sorted(committed_on_storage):
        row = rows.get(step)
        if row is not None and row.state == "committed":
            report.count(SyncOutcome.UNCHANGED.value)
            continue
        try:
            manifest = store.read_manifest(storage_run, step)
        except CorruptCheckpointError as exc:
            report.problems.append(f"run {name} step {step}: {exc}")
            continue
        _, outcome = catalog.upsert_committed(
            name,
            step,
            store.checkpoint_url(storage_run, step),
            bytes=manifest.total_bytes,
            file_count=manifest.file_count,
            manifest_checksum=manifest.checksum(),
            metadata=manifest.metadata or None,
            committed_at=_parse_time(manifest.committed_at),
        )
        report.count(outcome.value)
    for step, row in rows.items():
        missing = row.state == "committed" and step not in committed_on_storage
        if missing and catalog.mark_missing(name, step):
            report.marked_missing.append((name, step))
