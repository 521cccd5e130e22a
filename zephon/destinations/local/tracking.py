"""What the checkpoint manager tells the catalog about its tiers: the replica rows of a
checkpoint's copies (``local`` on a node, ``save_dir``), with their sizes and timings.

These records describe copies; they never decide what a checkpoint is (the
marker, the lineage and the ``checkpoints`` row do, ``zephon.reconcile``). So a record that
cannot be written is one warning on the ``zephon`` logger, never a failed save; without a
catalog nothing is recorded and everything works the same.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Any

from zephon.catalog import Catalog, InvalidTransitionError
from zephon.storage import Manifest, redact

__all__ = ["LOCAL", "MEMORY", "SAVE_DIR", "Tracker"]

log = logging.getLogger("zephon")

#: replica tiers: a node's host memory (host = the node's name), a node's local disk (host =
#: its hostname) and the job's save_dir (host "")
MEMORY = "memory"
LOCAL = "local"
SAVE_DIR = "save_dir"


class Tracker:
    """Replica rows of one run in the catalog, if there is one (rank 0 only)."""

    def __init__(self, catalog: Catalog | None, name: str) -> None:
        self.catalog = catalog
        self.name = name
        self.host = socket.gethostname()

    def _call(self, method: str, step: int, *args: Any, **kwargs: Any) -> Any:
        if self.catalog is None:
            return None
        call = getattr(self.catalog, method)
        try:
            return call(self.name, step, *args, **kwargs)
        except InvalidTransitionError as exc:
            # e.g. failing a save_dir replica already committed, or a row a newer save
            # re-armed: the row keeps what it says
            log.debug("zephon: run %s step %d: %s not recorded: %s", self.name, step, method, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a record, never a reason to fail a save
            log.warning(
                "zephon: run %s step %d: could not record %s in the catalog (%s)",
                self.name,
                step,
                method,
                redact(f"{type(exc).__name__}: {exc}")[:300],
            )
            return None

    def host_of(self, tier: str, host: str | None = None) -> str:
        """The row's host: ``host`` if given (a memory copy names its node), this host for a
        local copy, "" for save_dir."""
        if host is not None:
            return host
        return self.host if tier == LOCAL else ""

    def started(
        self, step: int, tier: str, location: str, save_id: str, *, host: str | None = None
    ) -> None:
        self._call(
            "replica_started",
            step,
            tier=tier,
            host=self.host_of(tier, host),
            location=location,
            save_id=save_id,
        )

    def committed(
        self,
        step: int,
        tier: str,
        manifest: Manifest,
        timings: Mapping[str, float] | None = None,
        *,
        host: str | None = None,
        size: int | None = None,
    ) -> None:
        self._call(
            "replica_committed",
            step,
            tier=tier,
            host=self.host_of(tier, host),
            save_id=manifest.save_id,
            bytes=manifest.total_bytes if size is None else size,
            timings=dict(timings) if timings else None,
        )

    def failed(
        self, step: int, tier: str, save_id: str, reason: str, *, host: str | None = None
    ) -> None:
        self._call(
            "replica_failed",
            step,
            tier=tier,
            host=self.host_of(tier, host),
            save_id=save_id,
            reason=redact(reason)[:2000],
        )

    def deleted(self, step: int, tier: str, *, host: str | None = None) -> None:
        self._call("replica_deleted", step, tier=tier, host=self.host_of(tier, host))

    def superseded(self, step: int, by: list[int], reason: str) -> None:
        """A failed upload of ``step`` given up for the newer steps ``by`` (retention would drop
        it once they are uploaded): an ``upload_superseded`` event, the replica row stays
        failed with its last reason."""
        if self.catalog is None:
            return
        try:
            self.catalog.record_event(
                "upload_superseded",
                run=self.name,
                step=step,
                detail={"superseded_by": by, "last_failure": redact(reason)[:500]},
            )
        except Exception as exc:  # noqa: BLE001 - a record, never a reason to fail an upload
            log.warning(
                "zephon: run %s step %d: could not record upload_superseded in the catalog (%s)",
                self.name,
                step,
                redact(f"{type(exc).__name__}: {exc}")[:300],
            )
