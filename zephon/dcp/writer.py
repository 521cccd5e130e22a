"""``ZephonStorageWriter``: DCP's StorageWriter on Zephon's commit protocol.

Every rank writes its own shard files through its own ``CheckpointWriter`` (so size and CRC32C
are recorded while the bytes go out); each rank's ``WriteResult``s carry the slices the reader
needs and the ``FileEntry`` of every file the rank wrote. Every item's bytes are checksummed
once: the CRC32C goes into its slice (for the reader to check on load) and is combined into the
file's CRC for the manifest, so the file is never read twice. Each tensor is written as a
``torch.save`` blob (``zephon.dcp.stock_format``): its slice names the raw elements inside it, so
Zephon's reader reads them directly, while torch's stock readers load the whole blob. The
coordinator's ``finish`` adds all ranks' entries to its primary writer and commits with the JSON
metadata and torch's pickled ``.metadata`` as the save's last files (written beside the
commit's checks): the marker appears last, listing every rank's files and carrying a copy of
the JSON metadata, or not at all.
"""

from __future__ import annotations

import dataclasses
import heapq
import io
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from zephon.dcp.errors import WriterSetupError
from zephon.dcp.metadata_codec import FORMAT_VERSION, ShardSlice, dtype_name, encode_metadata
from zephon.dcp.stock_format import STOCK_METADATA_FILE, ShardStream, own_storage, stock_metadata
from zephon.errors import ArgumentTypeError, UsageError
from zephon.storage import (
    CHUNK_SCOPES,
    CheckpointWriter,
    ChunkRef,
    FileEntry,
    Manifest,
    crc32c_extend,
    encode_crc32c,
    validate_file_name,
)

__all__ = ["METADATA_FILE", "ZephonStorageWriter", "shard_prefix"]

#: name of the JSON metadata file inside the checkpoint (under ``subdir`` if one is given)
METADATA_FILE = "dcp_metadata.json"
#: version of torch DCP's metadata semantics these files follow (torch's FileSystemWriter's)
_DCP_VERSION = "1.0.0"

CommitMetadata = Mapping[str, Any] | Callable[[Metadata], Mapping[str, Any]]


@dataclass(frozen=True)
class _RankPlan:
    """What a rank tells the coordinator about the checkpoint it writes into."""

    rank: int
    run: str | None
    step: int
    save_id: str
    url: str


@dataclass(frozen=True)
class _FilePrefix:
    """The coordinator's answer: the rank-unique prefix of this rank's shard file names, and
    for a deduplicated save the chunks of the base this rank's shards may refer to."""

    prefix: str
    base: tuple[ChunkRef, ...] | None = None
    #: where a deduplicated save's chunks go (``storage.chunks.CHUNK_SCOPES``)
    scope: str = "run"


#: A deduplicated save's base, asked on the coordinator before any rank writes: the manifest
#: of the newest committed checkpoint of the save's history (None: there is none yet).
DedupBase = Callable[[], "Manifest | None"]


@dataclass(frozen=True)
class _Written:
    """A ``WriteResult.storage_data``: the item's slice, where torch's stock reader finds it
    (relative to the payload directory), and the entry of the file holding it."""

    slice: ShardSlice
    stock: _StorageInfo
    entry: FileEntry


def _shard_rank(name: str) -> int | None:
    """The rank whose shard file ``name`` (``__<rank>_<i>.distcp``) is, else None."""
    if not name.startswith("__") or not name.endswith(".distcp"):
        return None
    head = name[2:].split("_", 1)[0]
    return int(head) if head.isdigit() and len(head) < 8 else None


def shard_prefix(subdir: str) -> str:
    """``subdir`` as a file-name prefix (``""`` or ``"a/b/"``), validated like a file name."""
    subdir = subdir.strip("/")
    if not subdir:
        return ""
    validate_file_name(f"{subdir}/x")
    return f"{subdir}/"


def _dense_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a dense CPU tensor owning exactly its storage, its elements in C order
    (a copy only if it was not contiguous, not on the CPU, a view of a larger storage, or a lazy
    conjugate/negative view)."""
    t = tensor.detach()
    if t.layout != torch.strided or t.is_quantized:
        raise ArgumentTypeError(
            f"cannot save a {t.layout} {'quantized ' if t.is_quantized else ''}tensor: Zephon "
            "writes dense tensors; convert it (e.g. .to_dense() or .dequantize()) first"
        )
    if t.device.type != "cpu":
        t = t.to("cpu")
    return own_storage(t.resolve_conj().resolve_neg())


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is not None:
        return item.tensor_storage_size() or 0
    if item.bytes_io_data is not None:
        return item.bytes_io_data.nbytes
    return 0


#: a rank's items below this many bytes go into one shard file written by the calling thread:
#: for a small save, the threads, files and fsyncs of a parallel write cost more than they gain
SMALL_PLAN_BYTES = 1 << 20


def _balance(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Split items into at most ``bins`` groups of similar byte size (largest first onto the
    lightest group), each kept in plan order so a loader reads neighbours together; items
    below ``SMALL_PLAN_BYTES`` in all stay one group."""
    if sum(_item_bytes(item) for item in items) < SMALL_PLAN_BYTES:
        bins = 1
    bins = max(1, min(bins, len(items)))
    heap = [(0, i) for i in range(bins)]
    groups: list[list[tuple[int, WriteItem]]] = [[] for _ in range(bins)]
    order = sorted(enumerate(items), key=lambda p: _item_bytes(p[1]), reverse=True)
    for position, item in order:
        size, b = heapq.heappop(heap)
        groups[b].append((position, item))
        heapq.heappush(heap, (size + _item_bytes(item), b))
    return [[item for _, item in sorted(g, key=lambda p: p[0])] for g in groups if g]


class ZephonStorageWriter(StorageWriter):
    """Writes one DCP checkpoint into a Zephon checkpoint directory.

    Construct one per rank per save. The coordinator rank (rank 0 of the process group) passes
    the *primary* writer from ``store.run(run).begin(step)``; every other rank passes a *secondary*
    one from ``store.run(run).attach(step, save_id=primary.save_id)``. The caller must make
    sure ``begin`` has returned before any other rank writes (``attach_ranks`` does): ``begin``
    checks the fence, so a stale attempt stops before any rank writes a byte.

    ``commit_metadata`` (a mapping, or a function of the DCP ``Metadata`` returning one) is
    merged into the marker's metadata; the key ``"dcp"`` is reserved for this writer's own
    description. ``on_commit`` is called on the coordinator with the committed ``Manifest``
    (also kept as ``self.manifest``); an exception it raises fails the save call although the
    checkpoint is already complete. A failure anywhere leaves the checkpoint uncommitted; the
    caller may ``abort()`` the primary writer, or leave the directory for the next ``begin`` or
    ``zephon gc``.
    """

    def __init__(
        self,
        writer: CheckpointWriter,
        *,
        subdir: str = "",
        thread_count: int = 4,
        commit_metadata: CommitMetadata | None = None,
        on_commit: Callable[[Manifest], None] | None = None,
        dedup_base: DedupBase | None = None,
        dedup_scope: str = "run",
    ) -> None:
        """``dedup_base``: store the shards as content-addressed chunks, referring to the
        chunks of the checkpoint it returns (docs/dedup.md); None: plain files.
        ``dedup_scope``: where the chunks go, ``run`` or ``save_dir``."""
        super().__init__()
        if not isinstance(writer, CheckpointWriter):
            raise ArgumentTypeError(
                f"ZephonStorageWriter needs a storage.CheckpointWriter (from store.begin or "
                f"store.attach), got {type(writer).__name__}"
            )
        self.writer = writer
        self._configure(subdir, thread_count, commit_metadata, on_commit, dedup_base, dedup_scope)

    def _configure(
        self,
        subdir: str,
        thread_count: int,
        commit_metadata: CommitMetadata | None,
        on_commit: Callable[[Manifest], None] | None,
        dedup_base: DedupBase | None = None,
        dedup_scope: str = "run",
    ) -> None:
        """The settings every writer of this class holds (shared with ``zephon.dcp.Writer``,
        which binds its ``CheckpointWriter`` per save)."""
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise UsageError(f"thread_count = {thread_count!r} is invalid: use an integer >= 1")
        self.prefix = shard_prefix(subdir)
        self.thread_count = thread_count
        self._commit_metadata = commit_metadata
        self._on_commit = on_commit
        if dedup_scope not in CHUNK_SCOPES:
            raise UsageError(
                f"dedup_scope = {dedup_scope!r} is invalid: use one of {', '.join(CHUNK_SCOPES)}"
            )
        self._dedup_base = dedup_base
        self._dedup_scope = dedup_scope
        self.is_coordinator = False
        self.rank = 0
        #: the committed manifest, on the coordinator once ``finish`` succeeded
        self.manifest: Manifest | None = None

    def _save_failed(self, exc: BaseException) -> None:
        """Told by ``zephon.dcp.save``/``async_save`` that the save failed; nothing to do here
        (the caller owns the ``CheckpointWriter``)."""

    # -- identity -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The checkpoint directory's URL (credentials masked)."""
        return self.writer.url

    @property
    def checkpoint_id(self) -> str:
        return self.writer.url

    @property
    def metadata_name(self) -> str:
        return f"{self.prefix}{METADATA_FILE}"

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """DCP calls this when ``checkpoint_id=`` is passed; the writer is already bound to one
        checkpoint, so only that checkpoint's own URL or path is accepted."""
        if checkpoint_id is None:
            return
        given = os.fspath(checkpoint_id)
        if given.rstrip("/") not in {self.writer.url.rstrip("/"), self.writer.path.rstrip("/")}:
            raise WriterSetupError(
                f"this ZephonStorageWriter writes {self.url}, not {given!r}; call dcp.save "
                "with storage_writer= only, and begin a new writer for another checkpoint"
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        # Never picked automatically from a bare path: it needs a CheckpointWriter.
        return False

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.writer.url, save_id=self.writer.save_id)

    # -- planning ------------------------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """All ranks: check that the role DCP gives this rank matches the writer it holds."""
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        if not kwargs.get("use_collectives", True):
            raise WriterSetupError(
                f"saving {self.url} without collectives (use_collectives=False) would make every "
                "rank commit on its own; Zephon commits once, on the coordinator: use the default"
            )
        if is_coordinator and not self.writer.primary:
            raise WriterSetupError(
                f"the coordinator rank {self.rank} holds a secondary writer of {self.url}; it must "
                "pass the primary writer from store.run(run).begin(step)"
            )
        if not is_coordinator and self.writer.primary:
            raise WriterSetupError(
                f"rank {self.rank} holds the primary writer of {self.url}, but only the "
                "coordinator may commit: begin on the coordinator, broadcast its save_id, and "
                "use store.run(run).attach(step, save_id=...) on every other rank"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        w = self.writer
        info = _RankPlan(self.rank, w.run, w.step, w.save_id, w.url)
        return dataclasses.replace(plan, storage_data=info)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator only: refuse ranks that write into another checkpoint or attempt, and
        give each rank its file-name prefix ``__<rank>_``."""
        w = self.writer
        wrong = []
        for i, plan in enumerate(plans):
            info = plan.storage_data
            if not isinstance(info, _RankPlan):
                wrong.append(f"rank {i} does not use ZephonStorageWriter")
            elif (info.run, info.step, info.save_id) != (w.run, w.step, w.save_id):
                wrong.append(
                    f"rank {i} writes {info.url} save {info.save_id[:12]}"
                    if (info.run, info.step) != (w.run, w.step)
                    else f"rank {i} writes save {info.save_id[:12]}"
                )
        if wrong:
            raise WriterSetupError(
                f"the coordinator writes {self.url} save {w.save_id[:12]}, but "
                f"{'; '.join(wrong)}: broadcast the primary writer's save_id and attach every "
                "rank to the same run, step and attempt"
            )
        prefixes = self._file_prefixes(len(plans))
        return [
            dataclasses.replace(plan, storage_data=prefix)
            for plan, prefix in zip(plans, prefixes, strict=True)
        ]

    def _file_prefixes(self, ranks: int) -> list[_FilePrefix]:
        """Coordinator: each rank's file-name prefix ``__<rank>_`` and, for a deduplicated
        save, the base's chunks of that rank's shard files (a rank writes the same tensors
        from one save to the next, so that is where its unchanged bytes are)."""
        if self._dedup_base is None:
            return [_FilePrefix(f"__{i}_") for i in range(ranks)]
        base = self._dedup_base()
        scope = self._dedup_scope
        if base is not None:
            self.writer.keep_base(base, scope=scope)  # the commit re-checks that it is there
        per_rank: list[dict[str, ChunkRef]] = [{} for _ in range(ranks)]
        for entry in base.files if base is not None else ():
            head = entry.name[len(self.prefix) :] if entry.name.startswith(self.prefix) else ""
            rank = _shard_rank(head)
            if entry.chunks and rank is not None and rank < ranks and base.chunk_scope == scope:
                per_rank[rank].update((c.sha256, c) for c in entry.chunks)
        return [
            _FilePrefix(f"__{i}_", tuple(refs.values()), scope) for i, refs in enumerate(per_rank)
        ]

    # -- writing -------------------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """All ranks: write this rank's items into ``thread_count`` shard files in parallel
        (one file, written by this thread, when they come to less than ``SMALL_PLAN_BYTES``).

        Returns once every file is written (the future is already complete); on failure the
        first error is raised after the other files finished or failed.
        """
        target = plan.storage_data
        if not isinstance(target, _FilePrefix):
            raise WriterSetupError(
                f"rank {self.rank} got no file prefix for {self.url}: the coordinator is not "
                "using ZephonStorageWriter"
            )
        if target.base is not None:
            self.writer.deduplicate({c.sha256: c for c in target.base}, scope=target.scope)
        groups = _balance(list(plan.items), self.thread_count)
        names = [f"{self.prefix}{target.prefix}{i}.distcp" for i in range(len(groups))]
        results: list[WriteResult] = []
        if len(groups) == 1:
            results = self._write_file(names[0], groups[0], planner)
        elif groups:
            with ThreadPoolExecutor(len(groups), thread_name_prefix="zephon-dcp-write") as pool:
                futures = [
                    pool.submit(self._write_file, n, g, planner)
                    for n, g in zip(names, groups, strict=True)
                ]
                first_error: BaseException | None = None
                for f in futures:
                    try:
                        results.extend(f.result())
                    except BaseException as exc:  # noqa: BLE001 - re-raised once all finished
                        first_error = first_error or exc
                if first_error is not None:
                    raise first_error
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        placed: list[tuple[WriteItem, ShardSlice, _StorageInfo]] = []
        relative = name[len(self.prefix) :]
        with self.writer.open_chunked(name) as out:  # plain unless the save deduplicates

            def emit(view: memoryview) -> int:
                # One native pass (GIL released) for the piece's CRC; the storage writer
                # combines it into the file's CRC instead of checksumming the bytes again.
                # The stream's views stay valid (a tensor's own memory, or a buffer never
                # reused), so an object store's upload sends them where they lie.
                crc = crc32c_extend(0, view)
                out.write(view, crc=crc, in_place=True)
                return crc

            stream = ShardStream(emit)
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    if not isinstance(data, io.BytesIO):
                        raise ArgumentTypeError(
                            f"planner resolved bytes item {item.index.fqn!r} to "
                            f"{type(data).__name__}: its resolve_data must return io.BytesIO"
                        )
                    view = data.getbuffer()
                    try:
                        length = view.nbytes
                        start, crc = stream.add_bytes(view)
                    finally:
                        view.release()
                    where = ShardSlice(name, start, length, "bytes", crc32c=encode_crc32c(crc))
                    stock = _StorageInfo(relative, start, length)
                else:
                    if not isinstance(data, torch.Tensor):
                        raise ArgumentTypeError(
                            f"planner resolved tensor item {item.index.fqn!r} to "
                            f"{type(data).__name__}: its resolve_data must return a torch.Tensor"
                        )
                    tensor = _dense_cpu(data)
                    # torch.save's blob, so torch's stock readers load it; Zephon's slice
                    # names only the raw bytes inside it
                    blob = stream.add_tensor(tensor)
                    where = ShardSlice(
                        name,
                        blob.start + blob.raw_offset,
                        blob.raw_length,
                        "raw",
                        dtype_name(tensor.dtype),
                        tuple(tensor.shape),
                        crc32c=encode_crc32c(blob.raw_crc32c),
                    )
                    stock = _StorageInfo(relative, blob.start, blob.length)
                placed.append((item, where, stock))
            stream.close()
        entry = next(e for e in self.writer.entries if e.name == name)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=stock.length,
                storage_data=_Written(where, stock, entry),
            )
            for item, where, stock in placed
        ]

    # -- commit --------------------------------------------------------------------------------

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only, after every rank wrote: record every rank's files in the primary
        writer, then commit: the JSON metadata and torch's own ``.metadata`` (for stock
        readers) are written with the commit's checks, and the marker, written last, carries
        a copy of the JSON metadata."""
        slices = {}
        stock = {}
        entries: dict[str, FileEntry] = {}
        for rank, rank_results in enumerate(results):
            for result in rank_results:
                written = result.storage_data
                if not isinstance(written, _Written):
                    raise WriterSetupError(
                        f"rank {rank} reported a result not written by ZephonStorageWriter for "
                        f"{result.index.fqn!r}; every rank must use ZephonStorageWriter"
                    )
                slices[result.index] = written.slice
                stock[result.index] = written.stock
                entries[written.entry.name] = written.entry
        metadata.version = metadata.version or _DCP_VERSION
        metadata.storage_data = slices
        metadata.storage_meta = self.storage_meta()
        self.writer.add_entries(entries.values())
        extra = self._commit_metadata
        extra = dict(extra(metadata) if callable(extra) else extra or {})
        extra["dcp"] = {
            "format_version": FORMAT_VERSION,
            "metadata": self.metadata_name,
            "stock_metadata": f"{self.prefix}{STOCK_METADATA_FILE}",
            "ranks": len(results),
            "shard_files": len(entries),
        }
        # The metadata files go out with the commit's fence re-check and payload listing, in
        # one wave, and the marker carries a copy of the JSON metadata (when it is small), so
        # a load reads both with one request. The stock file costs no extra round trip.
        self.manifest = self.writer.commit(
            extra,
            files={
                self.metadata_name: encode_metadata(metadata),
                f"{self.prefix}{STOCK_METADATA_FILE}": stock_metadata(metadata, stock),
            },
            inline=[self.metadata_name],
        )
        if self._on_commit is not None:
            self._on_commit(self.manifest)
