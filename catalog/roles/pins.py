"""``Catalog``'s pins: keep a checkpoint whatever the retention policy, or stop keeping it."""

from __future__ import annotations

from zephon.catalog import transitions, validate
from zephon.catalog.records import CheckpointRecord
from zephon.catalog.session_base import CatalogBase, utc_now

__all__ = ["PinMethods"]


class PinMethods(CatalogBase):
    """The pins role of ``Catalog``: ``pin`` and ``unpin``."""

    def pin(self, run: str, step: int) -> CheckpointRecord:
        """Keep this checkpoint whatever the retention policy. Only pending or committed rows
        can be pinned (``InvalidTransitionError`` otherwise, e.g. while gc deletes it)."""
        return self._set_pinned(run, step, True)

    def unpin(self, run: str, step: int) -> CheckpointRecord:
        """Let retention decide about this checkpoint again. Idempotent, any state."""
        return self._set_pinned(run, step, False)

    def _set_pinned(self, run: str, step: int, pinned: bool) -> CheckpointRecord:
        run, step = validate.run_name(run), validate.step(step)
        event = "pinned" if pinned else "unpinned"
        verb = "pin" if pinned else "unpin"
        with self._run_transaction(f"{verb} run {run!r} step {step}", run) as transaction:
            row, changed = transitions.set_pinned(
                transaction.session, self.url, transaction.run, step, pinned, utc_now()
            )
            if changed:
                transaction.event(event, step)
            return CheckpointRecord.of(row, run)
