"""The direct destination: a save commits straight into ``save_dir``; rank 0 records the
catalog row and applies the session's retention after each commit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zephon.destinations.base import Destination
from zephon.saving import Save

if TYPE_CHECKING:
    from zephon.attempts import Attempt
    from zephon.session import RunSession

__all__ = ["DirectDestination"]


class DirectDestination(Destination):
    """Saves into the session's store (``save_dir``); no background work, no copy of its own."""

    def __init__(self, session: RunSession) -> None:
        self.session = session
        self.store = session.location.store

    def begin(self, attempt: Attempt, step: int) -> Save:
        return Save.begin(attempt, step, catalog=self.session.catalog)

    def committed(self, save: Save, timings: dict[str, float], started: float) -> None:
        """The catalog row committed (with the save's timings), then retention."""
        save.committed(timings=timings)
        self.session.retain()

    def checkpoint_url(self, step: int) -> str:
        return self.store.run(self.session.location.storage_run).checkpoint_url(step)
