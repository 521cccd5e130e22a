"""``ZephonStorageReader``: DCP's StorageReader over a committed Zephon checkpoint.

Opens the checkpoint through ``CheckpointStore.reader`` (an uncommitted one is refused), checks
that every slice the JSON metadata names lies inside a file the marker lists
(``zephon.dcp.load_checks``), then reads only the byte ranges the load plan needs
(``zephon.dcp.read_plan``), each run of neighbouring items of one file as one stream straight
into the destination tensors: ``preadv`` on local disk, one streamed ranged GET on object
stores (``zephon.dcp.range_fetch``). This module is the StorageReader protocol that ties them
together.

With ``verify`` (the default) every slice's bytes are checked against the CRC32C the writer
recorded for it, as they arrive, so no byte reaches the model unchecked and nothing is read
twice; see ``ZephonStorageReader``.

No code runs from storage, whatever planner the caller uses: a non-tensor item is rebuilt by
the restricted unpickler before any planner sees it, and a stock
planner (``DefaultLoadPlanner`` unpickles with ``weights_only=False``) receives a pickle this
reader wrote of that rebuilt object, never the checkpoint's own bytes (``zephon.dcp.untrusted``).
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from zephon.dcp.load_checks import check_slices, read_checked_file
from zephon.dcp.metadata_codec import ShardSlice, decode_metadata
from zephon.dcp.range_fetch import RangeFetcher
from zephon.dcp.read_plan import group_reads, plan_read
from zephon.dcp.untrusted import check_read_kind
from zephon.dcp.writer import METADATA_FILE, shard_prefix
from zephon.errors import UsageError
from zephon.storage import CheckpointReader, CheckpointStore, CorruptCheckpointError, Manifest

__all__ = ["MAX_REQUEST_BYTES", "THREAD_COUNT", "ZephonStorageReader"]

#: default largest ranged GET on object stores (and largest read group on local disk): a run of
#: neighbouring slices up to this size is one request, its reply streamed into the destination
#: tensors in chunks (``storage.backends.native.STREAM_CHUNK``), so what a reader thread holds
#: does not grow with it; a store that reads a whole object per ranged GET then reads it once
MAX_REQUEST_BYTES = 256 << 20
#: default reader threads, local and remote
THREAD_COUNT = 4
#: on local disk, the largest gap between two slices that one ``preadv`` reads through (into a
#: scratch buffer) rather than starting a new group: the framing between a file's tensors
LOCAL_GAP_BYTES = 64 << 10


class ZephonStorageReader(StorageReader):
    """Reads a committed checkpoint ``(run, step)`` of ``store`` for ``dcp.load``.

    Construct one on every rank. Every slice the metadata names is checked against the
    manifest's file sizes, and a missing file or a short read raises the storage layer's
    ``CorruptCheckpointError`` naming the file, whatever ``verify`` says.

    ``verify=True`` (the default) also checks every slice this rank reads against the CRC32C
    recorded for it at save time, while its bytes arrive: neighbouring slices of a file are one
    run, read as one stream straight into their destinations (``zephon.dcp.landing``), and each
    1 MiB that lands (a ``preadv`` window on local disk, a chunk of the streamed ranged GET on
    object stores) is fed to its slices' running CRCs while still in the CPU cache; the checksum
    runs in the reader threads without the GIL. A mismatch raises
    ``CorruptCheckpointError`` naming the file and the item. To make that possible a read that
    needs only some rows of a saved slice (a resharded load) fetches the whole slice and cuts
    it in memory. Checkpoints of metadata format version 1 have no per-slice CRC: they are
    deep-verified once (every file's CRC32C against the manifest) before anything is loaded.
    ``verify=False`` reads only the bytes needed and checks nothing but sizes: damaged bytes
    then load silently.

    A failure to open the checkpoint is kept in ``self.failure``: DCP replaces it with an
    AssertionError on its way through ``dcp.load``, and ``zephon.dcp.load`` raises it instead.
    """

    def __init__(
        self,
        store: CheckpointStore,
        run: str | None,
        step: int | None,
        *,
        subdir: str = "",
        verify: bool = True,
        thread_count: int | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_gap_bytes: int = 1 << 20,
    ) -> None:
        super().__init__()
        if thread_count is not None and thread_count < 1:
            raise UsageError(f"thread_count = {thread_count!r} is invalid: use an integer >= 1")
        if max_request_bytes < 1:
            raise UsageError(
                f"max_request_bytes = {max_request_bytes!r} is invalid: use an integer >= 1"
            )
        self.store = store
        self.run = run
        self.step = step
        self.prefix = shard_prefix(subdir)
        self.verify = verify
        local = store.location.backend.posix_paths
        self.thread_count = thread_count or THREAD_COUNT
        self.max_request_bytes = max_request_bytes
        # Local reads land straight in the destination tensors: only a small gap is read through.
        self.max_gap_bytes = min(max_gap_bytes, LOCAL_GAP_BYTES) if local else max_gap_bytes
        # (step None: ``zephon.dcp.Reader`` finds the step when it first opens the checkpoint)
        self.url = (
            store.run(run).checkpoint_url(step)
            if step is not None
            else store.location.display(store.run(run).run_path())
        )
        self.failure: BaseException | None = None
        self._reader: CheckpointReader | None = None
        self._metadata: Metadata | None = None
        self._slices: dict[Any, ShardSlice] = {}
        self._known: Manifest | None = None
        self._lock = threading.Lock()
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @property
    def manifest(self) -> Manifest | None:
        """The checkpoint's manifest, once ``read_metadata`` has run."""
        return self._reader.manifest if self._reader is not None else None

    @property
    def metadata_name(self) -> str:
        return f"{self.prefix}{METADATA_FILE}"

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """DCP calls this when ``checkpoint_id=`` is passed: only this checkpoint's URL is
        accepted, since the reader is bound to one ``(run, step)``."""
        self.load_id = uuid.uuid4().hex
        if checkpoint_id is None:
            return
        given = os.fspath(checkpoint_id).rstrip("/")
        path = self.store.run(self.run).checkpoint_path(self.step)
        if given not in {self.url.rstrip("/"), path.rstrip("/")}:
            raise UsageError(
                f"this ZephonStorageReader reads {self.url}, not {given!r}; call dcp.load with "
                "storage_reader= only, and make a new reader for another checkpoint"
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    # -- metadata ------------------------------------------------------------------------------

    def read_metadata(self, *args: Any) -> Metadata:
        """All ranks: open the committed checkpoint, optionally verify it, and parse the JSON
        metadata (never unpickled)."""
        self.failure = None
        try:
            metadata = self._open()
        except BaseException as exc:
            self.failure = exc
            raise
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _open(self) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        reader = self._checkpoint_reader()
        name = self.metadata_name
        metadata = decode_metadata(read_checked_file(reader, name), where=f"{reader.url}/{name}")
        check_slices(metadata, reader, run=self.run, step=self.step, metadata_path=name)
        if self.verify and any(s.crc32c is None for s in (metadata.storage_data or {}).values()):
            # The legacy path (format version 1, no per-slice CRC): every file once, up front.
            self.store.run(self.run).verify(self.step, deep=True).raise_for_problems()
        self._reader = reader
        self._metadata = metadata
        return metadata

    def _checkpoint_reader(self) -> CheckpointReader:
        """The committed checkpoint: its marker read now (one GET), or the manifest the caller
        already read and checked (``use_manifest``)."""
        known, self._known = self._known, None
        if known is not None and (known.run, known.step) == (self.run, self.step):
            return CheckpointReader(self.store, known)
        return self.store.run(self.run).reader(self.step)

    def use_manifest(self, manifest: Manifest) -> None:
        """Open the checkpoint with ``manifest``, the marker of ``(run, step)`` the caller has
        just read and judged (``zephon.dcp.Reader`` after ``find_latest``), instead of reading
        it again: one round trip less. Used by the next open only."""
        self._known = manifest

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CorruptCheckpointError(
                f"DCP metadata of {self.url} has no storage_data; it was not written by "
                "ZephonStorageWriter",
                url=self.url,
                path=self.metadata_name,
            )
        self._slices = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # -- reading -------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """All ranks: read this rank's items in parallel and hand them to the planner."""
        if self._reader is None:
            self._open()
        reads = []
        for req in plan.items:
            where = self._slices.get(req.storage_index)
            if where is None:
                raise CorruptCheckpointError(
                    f"DCP metadata of {self.url} has no data for {req.storage_index.fqn!r} at "
                    f"{list(req.storage_index.offset or [])}; the checkpoint is incomplete",
                    url=self.url,
                    path=self.metadata_name,
                )
            check_read_kind(req, where, planner, url=self.url)
            reads.append(plan_read(req, where, check=self.verify))
        assert self._reader is not None
        fetcher = RangeFetcher(
            self._reader,
            self.url,
            self.run,
            self.step,
            local=self.store.location.backend.posix_paths,
            thread_count=self.thread_count,
            max_request_bytes=self.max_request_bytes,
            lock=self._lock,
        )
        groups = group_reads(
            reads, self.max_request_bytes, self.max_gap_bytes, min_groups=self.thread_count
        )
        fetcher.fetch(groups, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done
