"""The save path shared by the checkpoint manager and tools: a catalog row goes
``pending -> committed`` around the storage writer's commit.

Order matters for crash safety: the pending row exists before any byte is written (so gc and
the latest-probe know an attempt is under way), and the row is committed only after the marker
exists (a crash in between is repaired by ``find_latest``'s marker probe or by gc).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from catalog import Catalog
from storage import CheckpointWriter
from zephon.locations import RunLocation

__all__ = ["saving"]


@contextlib.contextmanager
def saving(
    location: RunLocation,
    step: int,
    *,
    catalog: Catalog | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Iterator[CheckpointWriter]:
    """Begin checkpoint ``step``; the block writes files and calls ``writer.commit()``.

    After a clean block the catalog row is committed with the manifest's facts. If the block
    raises, or returns without committing, the written files are removed and the row is marked
    failed. Call on the one process that commits (rank 0); other ranks ``attach``.
    """
    store, storage_run, name = location.store, location.storage_run, location.name
    row = None
    if catalog is not None:
        row = catalog.begin_checkpoint(name, step, location.checkpoint_url(step))
    writer = store.begin(storage_run, step, metadata=metadata, save_id=row.save_id if row else None)
    try:
        yield writer
        if writer.manifest is None:
            raise RuntimeError(
                f"checkpoint {writer.url} was not committed inside the saving() block; call "
                "writer.commit() once every file is written"
            )
    except BaseException as exc:
        with contextlib.suppress(Exception):
            writer.abort()
        if catalog is not None and row is not None:
            with contextlib.suppress(Exception):
                catalog.mark_failed(name, step, row.save_id, f"{type(exc).__name__}: {exc}")
        raise
    if catalog is not None and row is not None:
        manifest = writer.manifest
        catalog.mark_committed(
            name,
            step,
            row.save_id,
            bytes=manifest.total_bytes,
            file_count=manifest.file_count,
            manifest_checksum=manifest.checksum(),
            metadata=manifest.metadata or None,
        )
