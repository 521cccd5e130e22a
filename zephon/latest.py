"""Finding the latest complete checkpoint of a run: one catalog query, repaired by probing the
markers of newer pending rows, or a storage scan when there is no catalog."""

from __future__ import annotations

from dataclasses import dataclass, field

from catalog import Catalog, CheckpointRecord, RunNotFoundError, StateConflictError
from storage import CheckpointNotFoundError, CheckpointStore, CorruptCheckpointError, Manifest

__all__ = ["LatestCheckpoint", "find_latest", "record_commit"]


@dataclass(frozen=True, slots=True)
class LatestCheckpoint:
    """The newest complete checkpoint: its step, URL, manifest and how it was found."""

    step: int
    url: str
    manifest: Manifest
    source: str  # "catalog" or "storage"
    #: steps whose pending rows were promoted because their marker existed
    promoted: tuple[int, ...] = field(default=())
    #: steps whose committed rows lost their marker and were marked deleted
    missing: tuple[int, ...] = field(default=())


def record_commit(catalog: Catalog, name: str, row: CheckpointRecord, manifest: Manifest) -> None:
    """``pending -> committed`` with the facts of the manifest found on storage."""
    catalog.mark_committed(
        name,
        row.step,
        row.save_id,
        bytes=manifest.total_bytes,
        file_count=manifest.file_count,
        manifest_checksum=manifest.checksum(),
        metadata=manifest.metadata or None,
    )


def find_latest(
    store: CheckpointStore,
    storage_run: str | None,
    *,
    catalog: Catalog | None = None,
    name: str | None = None,
) -> LatestCheckpoint | None:
    """The latest complete checkpoint of a run, or None if it has none.

    With a catalog: the newest committed row (one indexed query); pending rows newer than it
    are probed for their marker (one request each) and promoted when it exists, so a crash
    between the marker and the catalog update is repaired here; a committed row whose marker
    has disappeared is marked deleted and the next one is tried. A run unknown to the catalog
    falls back to the storage scan. Without a catalog: the storage scan (one listing).
    """
    if catalog is not None:
        name = name or storage_run
        if name is None:
            raise ValueError("find_latest needs the catalog run name of an inference run")
        try:
            return _from_catalog(store, storage_run, catalog, name)
        except RunNotFoundError:
            pass
    step = store.latest_step(storage_run)
    if step is None:
        return None
    return LatestCheckpoint(
        step,
        store.checkpoint_url(storage_run, step),
        store.read_manifest(storage_run, step),
        "storage",
    )


def _from_catalog(
    store: CheckpointStore, storage_run: str | None, catalog: Catalog, name: str
) -> LatestCheckpoint | None:
    promoted: list[int] = []
    missing: list[int] = []

    def found(step: int, manifest: Manifest) -> LatestCheckpoint:
        url = store.checkpoint_url(storage_run, step)
        return LatestCheckpoint(step, url, manifest, "catalog", tuple(promoted), tuple(missing))

    while True:
        newest = catalog.latest_committed(name)
        for row in catalog.pending_after(name, newest.step if newest else None):
            try:
                manifest = store.read_manifest(storage_run, row.step)
            except (CheckpointNotFoundError, CorruptCheckpointError):
                continue  # still being written, or crashed: gc decides after the grace period
            try:
                record_commit(catalog, name, row, manifest)
            except StateConflictError:
                continue  # another process moved the row first; re-read below
            promoted.append(row.step)
            return found(row.step, manifest)
        if newest is None:
            return None
        try:
            manifest = store.read_manifest(storage_run, newest.step)
        except CheckpointNotFoundError:
            # Deleted behind the catalog's back: record it and try the next newest.
            catalog.mark_missing(name, newest.step)
            missing.append(newest.step)
            continue
        return found(newest.step, manifest)
