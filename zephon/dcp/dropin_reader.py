"""``zephon.dcp.Reader``: a drop-in DCP storage reader addressed by URL.

``dcp.load(sd, storage_reader=Reader("s3://bucket/ckpt/run"))`` on every rank loads the run's
latest complete checkpoint (or ``step=``), found as every Zephon reader finds it
(``zephon.latest.find_latest``: the catalog first, a storage scan without one), with every byte
checked against its CRC32C by ``ZephonStorageReader``. ``reader.step`` then says which step.
With ``local_dir`` (the Writer's local tier) the latest checkpoint is read from the local copy
when that copy is the run's newest under its current lineage and this process holds it in full.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from zephon.catalog import Catalog
from zephon.dcp.addressing import check_step, parse_run_url, step_of_checkpoint_id
from zephon.dcp.errors import DCPError
from zephon.dcp.reader import MAX_REQUEST_BYTES, ZephonStorageReader
from zephon.destinations import TierConfig
from zephon.errors import ConfigError
from zephon.latest import LatestCheckpoint, find_latest
from zephon.locations import RunLocation
from zephon.session import CatalogArg, resolve_catalog
from zephon.storage import (
    CheckpointNotFoundError,
    CheckpointStore,
    Manifest,
    RetryPolicy,
    StorageError,
)

__all__ = ["Reader", "ReaderDisagreementError"]


class ReaderDisagreementError(DCPError, ValueError):
    """The ranks of one load would read different checkpoints (e.g. each found another latest
    step because a save committed meanwhile); raised on every rank before anything is read."""


@dataclass(frozen=True)
class _RankReads:
    """What a rank tells the coordinator it reads (``LoadPlan.storage_data``)."""

    rank: int
    root: str
    run: str
    step: int
    save_id: str


class Reader(ZephonStorageReader):
    """DCP ``StorageReader`` for the run at ``url`` (``<save_dir>/<run>``); construct it the same
    way on every rank.

    ``step=None`` loads the latest complete checkpoint, looked up when the load opens it (with
    ``catalog``, a ``catalog.Catalog`` or its URL, else ``$ZEPHON_CATALOG_URL`` if set: the
    catalog's answer, checked against the marker; without one, a storage scan; a Reader never
    registers an attempt); the step found stays this Reader's (``reader.step``)
    until ``dcp.load(..., checkpoint_id="<url>/save-<n>")`` names another. Every rank looks the
    step up itself; if they find different ones (a save committed in between), the load fails on
    every rank with ``ReaderDisagreementError`` before anything is read: load again.

    ``verify`` and the tuning arguments are ``ZephonStorageReader``'s. A run with no complete
    checkpoint raises ``storage.CheckpointNotFoundError``; with plain ``dcp.load`` it arrives
    inside DCP's ``CheckpointException`` (also kept in ``reader.failure``), and
    ``zephon.dcp.load`` raises it as it is.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        step: int | None = None,
        catalog: CatalogArg = None,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        verify: bool = True,
        subdir: str = "",
        thread_count: int | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_gap_bytes: int = 1 << 20,
        local_dir: str | os.PathLike | None = None,
    ) -> None:
        self.target = parse_run_url(url, "Reader")
        local = _local_dir(local_dir)
        step = check_step(step, "Reader")
        catalog = resolve_catalog(catalog, "Reader")  # the argument, else $ZEPHON_CATALOG_URL
        store = CheckpointStore(self.target.root, storage_options, retry=retry)
        try:
            super().__init__(
                store,
                self.target.run,
                step,
                subdir=subdir,
                verify=verify,
                thread_count=thread_count,
                max_request_bytes=max_request_bytes,
                max_gap_bytes=max_gap_bytes,
            )
        except ValueError as exc:
            store.close()
            raise ConfigError(f"Reader: {exc}") from None
        self._catalog_arg = catalog
        self._catalog: Catalog | None = catalog if isinstance(catalog, Catalog) else None
        self.location = RunLocation(self.target.run, store, self.target.run)
        self.rank = 0
        #: the run's store at ``url`` (``self.store`` is the local tier's while reading from it)
        self.remote = store
        self.local_store = CheckpointStore(local) if local is not None else None
        #: whether the checkpoint opened was read from ``local_dir``
        self.from_local = False

    # -- which checkpoint -------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """DCP calls this with ``dcp.load``'s ``checkpoint_id``: ``<url>/save-<step>`` makes
        this Reader read that step."""
        self.load_id = os.urandom(16).hex()
        if checkpoint_id is None:
            return
        step = step_of_checkpoint_id(checkpoint_id, self.target, self.remote, "Reader")
        if step != self.step or self.from_local:
            self.store, self.from_local = self.remote, False  # a named step is read from url
            self._bind(step)

    def _bind(self, step: int | None) -> None:
        self.step = step
        self.url = (
            self.store.run(self.run).checkpoint_url(step)
            if step is not None
            else self.store.location.display(self.store.run(self.run).run_path())
        )
        self._reader = None
        self._metadata = None

    def _open(self) -> Metadata:
        if self.step is None:
            lineage = self.remote.run(self.run).lineage() if self.local_store is not None else None
            try:
                manifest: Manifest | None = self._find_latest(lineage).manifest
            except CheckpointNotFoundError:
                if lineage is None:
                    raise
                manifest = None  # the local tier may hold one not uploaded yet
            local = self._local_copy(lineage, manifest.step if manifest is not None else -1)
            if local is not None:
                self.store, self.from_local, manifest = self.local_store, True, local
            elif manifest is None:
                raise self._none_found()
            self._bind(manifest.step)
            self.use_manifest(manifest)  # read and judged already: not read again
        return super()._open()

    def _local_copy(self, lineage: Any, remote_step: int) -> Manifest | None:
        """The local tier's newest checkpoint under the run's current ``lineage``, if it is at
        least ``url``'s latest and this process holds every file of it (marker, sizes); else
        None (``url`` is read). The copy's bytes are checked while reading, as any others."""
        if self.local_store is None or lineage is None:
            return None
        try:
            manifest = self.local_store.run(self.run).latest(lineage=lineage)
            if manifest is None or manifest.step < remote_step:
                return None
            if not _whole(manifest) or not self.local_store.run(self.run).verify(manifest.step).ok:
                return None
        except StorageError:
            return None
        return manifest

    def _find_latest(self, lineage: Any = None) -> LatestCheckpoint:
        """The latest checkpoint, its marker read and judged in one round trip (with a
        catalog: the catalog's answer, checked against the marker, its save's ``_CORRUPT``
        record and the run's attempts together; a row storage does not bear out is set aside
        and the next one taken)."""
        catalog = self._open_catalog()
        latest = find_latest(self.location, catalog=catalog, lineage=lineage, confirm=True)
        if latest is None:
            raise self._none_found()
        return latest

    def _none_found(self) -> CheckpointNotFoundError:
        run_url = self.remote.location.display(self.remote.run(self.run).run_path())
        return CheckpointNotFoundError(
            f"run {self.run!r} at {run_url} has no complete checkpoint to load: save one "
            "first, or check the Reader's url (and catalog)",
            url=run_url,
            run=self.run,
        )

    def _open_catalog(self) -> Catalog | None:
        if self._catalog is None and isinstance(self._catalog_arg, str):
            self._catalog = Catalog(self._catalog_arg)
        return self._catalog

    # -- every rank reads the same checkpoint ---------------------------------------------

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        manifest = self.manifest
        reads = _RankReads(
            self.rank,
            self.remote.location.canonical_url,  # a local copy's files are url's, byte for byte
            self.run,
            self.step if self.step is not None else -1,
            manifest.save_id if manifest is not None else "",
        )
        return dataclasses.replace(plan, storage_data=reads)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.rank = int(kwargs.get("rank") or 0)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: refuse a load whose ranks would read different checkpoints."""
        mine = (self.remote.location.canonical_url, self.run, self.step)
        wrong = []
        for i, plan in enumerate(plans):
            reads = plan.storage_data
            if not isinstance(reads, _RankReads):
                wrong.append(f"rank {i} does not use zephon.dcp.Reader")
            elif (reads.root, reads.run, reads.step) != mine:
                wrong.append(f"rank {i} reads run {reads.run!r} step {reads.step}")
        if wrong:
            raise ReaderDisagreementError(
                f"ranks disagree on the checkpoint to load: the coordinator reads {self.url}, but "
                f"{'; '.join(wrong)}: construct the Reader with the same url and step on every "
                "rank (with step=None, a save committed while they looked: load again)"
            )
        return [dataclasses.replace(plan, storage_data=None) for plan in plans]

    def close(self) -> None:
        """Close a catalog opened from its URL, and the store."""
        if self._catalog is not None and isinstance(self._catalog_arg, str):
            with contextlib.suppress(Exception):
                self._catalog.close()
            self._catalog = None
        self.remote.close()
        if self.local_store is not None:
            self.local_store.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _local_dir(local_dir: str | os.PathLike | None) -> str | None:
    """A Reader's ``local_dir``, checked as the Writer's (the manager's config key) is."""
    if local_dir is None:
        return None
    given = os.fspath(local_dir) if isinstance(local_dir, os.PathLike) else local_dir
    return TierConfig(local_dir=given, prefix="Reader").local_dir


def _whole(manifest: Manifest) -> bool:
    """Whether a local marker lists every rank's shard files: with local directories not
    shared, each lists only the files on its own disk (docs/tiers.md), which is not a
    checkpoint this process can load on its own."""
    dcp_facts = manifest.metadata.get("dcp") if isinstance(manifest.metadata, dict) else None
    wanted = dcp_facts.get("shard_files") if isinstance(dcp_facts, dict) else None
    if not isinstance(wanted, int):
        return False
    return sum(1 for f in manifest.files if f.name.endswith(".distcp")) == wanted
