"""``CheckpointStore``: the public face of the storage layer, one root URL; ``store.run(name)``
is the handle (``storage.run_store.RunStore``) of everything done to one run.

Validates, then delegates to the small modules beside it (layout, writer, scan, verify,
backend). Paths are plain ``str`` in the filesystem's own form; URLs shown to people have their
credentials masked.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from zephon.storage.backend import list_dirs
from zephon.storage.backends import Backend, PosixBackend
from zephon.storage.chunk_sweep import ChunkSweep, sweep_chunks
from zephon.storage.errors import InvalidArgumentError
from zephon.storage.layout import validate_run
from zephon.storage.leftovers import Orphan, find_orphans, remove_orphan
from zephon.storage.lineage import Lineage
from zephon.storage.location import Location, open_location
from zephon.storage.manifest import Manifest
from zephon.storage.markers import judge
from zephon.storage.retry import RetryPolicy
from zephon.storage.run_store import RunStore, new_save_id

__all__ = ["CheckpointStore", "Orphan", "new_save_id"]

#: ``CheckpointStore.max_workers`` by default on local disk, and on the other backends (each
#: backend class says its own ``default_workers``)
LOCAL_WORKERS = PosixBackend.default_workers
REMOTE_WORKERS = Backend.default_workers


class CheckpointStore:
    """Checkpoints under one root URL: ``<root>/<run>/save-<step>/`` (``run=None``: the
    inference layout ``<root>/save-<step>/``).

    Safe to share between threads. Several processes may use the same root at once; the commit
    marker's exclusive create decides between writers of the same step.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        max_workers: int | None = None,
        part_size: int = 8 << 20,
        role: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """``retry``: how transient backend failures (5xx, throttling, timeouts, broken
        connections) are tried again; by default ``storage.retry.DEFAULT_RETRY``, which rides
        out an outage of a minute (docs/storage.md, "Retries")."""
        if part_size < 5 << 20:
            raise InvalidArgumentError(
                f"part_size={part_size} is below S3's 5 MiB minimum multipart part; use >= 5242880"
            )
        if max_workers is not None and max_workers < 1:
            raise InvalidArgumentError(
                f"max_workers={max_workers} must be at least 1 (or None: the backend's default)"
            )
        self.location: Location = open_location(
            url, dict(storage_options or {}), role=role, retry=retry
        )
        #: threads writing or reading files of one checkpoint in parallel. By default the
        #: backend's ``default_workers``: 8 on local disk (bound by the disk and the CPU), 32
        #: elsewhere, where each upload mostly waits for its answer (as many as the S3
        #: connection pool, ``storage.backends.DEFAULT_POOL_CONNECTIONS``).
        self.max_workers = max_workers or self.location.backend.default_workers
        #: bytes per multipart part; files of at least two parts upload in parts. A file being
        #: written holds about three parts in memory (upload buffer, request body, socket
        #: buffer), so this bounds what an upload costs beyond the data itself. S3 allows 10,000
        #: parts: files above 80 GiB need a larger part_size.
        self.part_size = part_size
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def url(self) -> str:
        """The root URL, credentials masked."""
        return self.location.url

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def judge(self, lineage: Lineage, manifest: Manifest, *, condemned: bool = False) -> str | None:
        """Why the checkpoint ``manifest`` describes is not one to resume from (abandoned or
        unregistered lineage, condemned), or None if it is. The storage half of the one rule
        every reader shares (``storage.markers.judge``)."""
        return judge(lineage, manifest, condemned=condemned)

    # -- runs and gc -----------------------------------------------------------------------

    def run(self, name: str | None) -> RunStore:
        """The run ``name`` of this store (``None``: the inference layout
        ``<root>/save-<step>/``): its attempts, checkpoints, writers and readers.
        ``InvalidNameError`` for a name the layout refuses."""
        return RunStore(self, name)

    def runs(self) -> list[str]:
        """Names of the run directories under the root (one delimited listing)."""
        location = self.location
        found = list_dirs(location, location.root)
        names = []
        for name in found:
            with contextlib.suppress(Exception):
                names.append(validate_run(name))
        return sorted(n for n in names if n is not None)

    def has_inference_layout(self) -> bool:
        """Whether ``save-<step>`` directories sit directly under the root."""
        return bool(self.run(None).list_steps())

    def orphans(
        self,
        older_than_s: float,
        *,
        runs: Iterable[str | None] | None = None,
        now: float | None = None,
    ) -> list[Orphan]:
        """Leftovers older than ``older_than_s`` (``storage.leftovers.find_orphans``): payload
        directories of uncommitted steps and their loose files, and payload directories of
        committed steps that the marker does not name. ``runs`` limits the search (``None`` in
        it means the inference layout); by default every run and the inference layout."""
        targets: list[str | None] = list(runs) if runs is not None else [*self.runs(), None]
        layouts = [self.run(name).layout for name in targets]
        return find_orphans(self.location, layouts, older_than_s, now=now)

    def sweep_chunks(
        self,
        *,
        older_than_s: float,
        finished: Collection[str] = (),
        live: Callable[[], Collection[str]] | None = None,
    ) -> ChunkSweep:
        """Remove the store's own chunk instances (``<root>/_chunks/``: deduplicated saves with
        ``chunk_scope`` save_dir, and the inference layout's) that no marker of any run
        references and whose save is over (in ``finished``, or older than ``older_than_s`` and
        not one of ``live``'s); ``storage/chunk_sweep.py``. Reads every run's markers."""
        layouts = [self.run(name).layout for name in [*self.runs(), None]]
        return sweep_chunks(
            self.location,
            self.location.chunk_dir("save_dir", None),
            layouts,
            newest_epoch=None,
            older_than_s=older_than_s,
            finished=finished,
            executor=self.executor(),
            live=live,
        )

    def remove_orphan(self, orphan: Orphan) -> None:
        """Delete one leftover found by ``orphans``."""
        remove_orphan(self.location, self.run(orphan.run).layout, orphan)

    # -- shared by the runs of this store ----------------------------------------------

    def executor(self) -> ThreadPoolExecutor:
        """The store's thread pool (``max_workers`` threads, made on first use), shared by its
        writers' ``write_many`` and its parallel reads; shut down by ``close``."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.max_workers, thread_name_prefix="zephon-storage"
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
