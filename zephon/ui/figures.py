"""Goodput of the runs a page shows, kept between requests: a run's figures are computed
again only when the run changed, or after ``max_age_s``.

The figures of a run need an aggregate over every checkpoint row of it (the stall of each
save sits in the row's JSON timings); on SQLite that reading costs a few microseconds a row,
so a page of 50 runs of 1,000 checkpoints would spend most of its time there on every
refresh. The runs page already reads, for every run it shows, the values that move when a
run saves, commits, deletes or restarts (``RunSummary``: last activity, counts, epoch,
status): those are the key. Changes that touch none of them (an async save's stall recorded
after its commit, a restart's resume decision) show within ``max_age_s``.

``warm()`` fills the cache for every run of the catalog, a page at a time (the server runs it
in a background thread at start), so that first views do not pay for it either.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from zephon.catalog import Catalog, RunSummary

__all__ = ["GoodputCache"]

#: runs whose figures are computed together (one pair of batch queries)
BATCH = 100


def _key(summary: RunSummary) -> tuple:
    run = summary.run
    return (
        run.updated_at,
        run.epoch,
        run.status,
        summary.last_activity,
        summary.committed_count,
        summary.pending_count,
        summary.latest_step,
    )


class GoodputCache:
    """Goodput figures (``views.goodput_of``) per run name; thread-safe."""

    def __init__(
        self, catalog: Catalog, *, max_age_s: float = 300.0, max_entries: int = 100_000
    ) -> None:
        self._catalog = catalog
        self._max_age_s = max_age_s
        self._max_entries = max_entries
        self._entries: OrderedDict[str, tuple[tuple, float, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def figures(self, summaries: list[RunSummary]) -> dict[str, dict[str, Any]]:
        """The goodput of each run of ``summaries`` (a page of ``Catalog.run_page``)."""
        from zephon.ui.views import goodput_of

        now = time.monotonic()
        found: dict[str, dict[str, Any]] = {}
        stale: list[RunSummary] = []
        with self._lock:
            for summary in summaries:
                entry = self._entries.get(summary.run.name)
                if entry and entry[0] == _key(summary) and now - entry[1] < self._max_age_s:
                    found[summary.run.name] = entry[2]
                else:
                    stale.append(summary)
        for start in range(0, len(stale), BATCH):
            chunk = stale[start : start + BATCH]
            names = [s.run.name for s in chunk]
            saves = self._catalog.save_summaries(names)
            attempts = self._catalog.attempts_of(names)
            for summary in chunk:
                name = summary.run.name
                found[name] = goodput_of(summary.run, attempts[name], saves[name])
                self._store(name, (_key(summary), now, found[name]))
        return found

    def _store(self, name: str, entry: tuple) -> None:
        with self._lock:
            self._entries[name] = entry
            self._entries.move_to_end(name)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def warm(self) -> int:
        """Compute the figures of every run, ``BATCH`` at a time; how many runs there were."""
        offset = 0
        while True:
            page = self._catalog.run_page(offset=offset, limit=BATCH)
            self.figures(page.runs)
            offset += len(page.runs)
            if not page.runs or offset >= page.total:
                return offset
