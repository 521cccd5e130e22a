"""``ZephonStorageReader``: DCP's StorageReader over a committed Zephon checkpoint.

Opens the checkpoint through ``CheckpointStore.reader`` (an uncommitted one is refused), checks
that every slice the JSON metadata names lies inside a file the marker lists, then reads only the
byte ranges the load plan needs: on local disk straight into the destination tensors, on object
stores as ranged GETs that cover runs of neighbouring items of one file.

With ``verify`` (the default) every slice's bytes are checked against the CRC32C the writer
recorded for it, as they arrive, so no byte reaches the model unchecked and nothing is read
twice; see ``ZephonStorageReader``.

No code runs from storage, whatever planner the caller uses: a non-tensor item is rebuilt by
the restricted unpickler before any planner sees it, and a stock
planner (``DefaultLoadPlanner`` unpickles with ``weights_only=False``) receives a pickle this
reader wrote of that rebuilt object, never the checkpoint's own bytes (``zephon.dcp.untrusted``).
"""

from __future__ import annotations

import math
import os
import threading
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from storage import (
    CheckpointReader,
    CheckpointStore,
    CorruptCheckpointError,
    Manifest,
    crc32c_extend,
    decode_crc32c,
    encode_crc32c,
)
from zephon.dcp.errors import StateDictMismatchError
from zephon.dcp.metadata_codec import ShardSlice, decode_metadata, dtype_from_name
from zephon.dcp.untrusted import check_read_kind, deliver_bytes, kind_problem
from zephon.dcp.writer import METADATA_FILE, shard_prefix
from zephon.errors import UsageError

__all__ = ["MAX_REQUEST_BYTES", "THREAD_COUNT", "ZephonStorageReader"]

#: bytes read into the destination at a time while verifying: small enough that the CRC reads
#: them from the CPU cache the kernel's copy just filled, large enough that syscalls are few
_VERIFY_CHUNK = 1 << 20
#: default largest ranged GET on object stores: what each reader thread holds at most (plus the
#: transport's transient copy while a response is joined), however large a slice is
MAX_REQUEST_BYTES = 16 << 20
#: default reader threads, local and remote: with ``MAX_REQUEST_BYTES`` they bound the response
#: buffers of a load on an object store to about 4 x 2 x 16 MiB
THREAD_COUNT = 4


@dataclass(slots=True)
class _Read:
    """One ReadItem as a byte range of a shard file, and how to view those bytes."""

    req: ReadItem
    file: str
    start: int
    length: int
    dtype: torch.dtype | None  # None: a bytes item
    shape: tuple[int, ...] = ()
    #: (offset, length) per dimension still to cut from the bytes read; None if they are exact
    narrow: tuple[tuple[int, int], ...] | None = None
    #: the CRC32C the bytes read must have (they are then a whole saved slice); None: unchecked
    crc: int | None = None


@dataclass(slots=True)
class _Group:
    """Neighbouring reads of one file served by one request."""

    file: str
    start: int
    end: int
    reads: list[_Read] = field(default_factory=list)


def _plan_read(req: ReadItem, where: ShardSlice, *, check: bool) -> _Read:
    """The bytes to read for ``req``. With ``check`` (and a slice that records its CRC32C) the
    read covers the whole saved slice, so its CRC can be checked, and is cut in memory."""
    crc = decode_crc32c(where.crc32c) if check and where.crc32c is not None else None
    if where.encoding == "bytes":
        return _Read(req, where.file, where.offset, where.length, None, crc=crc)
    dtype = dtype_from_name(where.dtype or "")
    shape = tuple(where.shape or ())
    offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
    if len(offsets) != len(shape) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape, strict=True)
    ):
        raise StateDictMismatchError(
            f"read of {req.storage_index.fqn!r} at {list(offsets)} size {list(lengths)} lies "
            f"outside the saved chunk of shape {list(shape)}: load into a state shaped as the "
            "one saved"
        )
    if not shape:
        return _Read(req, where.file, where.offset, where.length, dtype, shape, crc=crc)
    # When only the first dimension is cut, the rows needed are one contiguous byte range; a
    # checked read takes that shortcut only when the range is the whole slice.
    rows_only = all(
        o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:], strict=True)
    )
    if rows_only and (crc is None or lengths[0] == shape[0]):
        row = math.prod(shape[1:]) * dtype.itemsize
        return _Read(
            req,
            where.file,
            where.offset + offsets[0] * row,
            lengths[0] * row,
            dtype,
            (lengths[0], *shape[1:]),
            crc=crc,
        )
    return _Read(
        req,
        where.file,
        where.offset,
        where.length,
        dtype,
        shape,
        tuple(zip(offsets, lengths, strict=True)),
        crc=crc,
    )


def _group_reads(reads: list[_Read], max_bytes: int, max_gap: int) -> list[_Group]:
    by_file: dict[str, list[_Read]] = {}
    for r in reads:
        by_file.setdefault(r.file, []).append(r)
    groups: list[_Group] = []
    for name, file_reads in by_file.items():
        file_reads.sort(key=lambda r: r.start)
        current: _Group | None = None
        for r in file_reads:
            end = r.start + r.length
            if (
                current is not None
                and r.start <= current.end + max_gap
                and max(end, current.end) - current.start <= max_bytes
            ):
                current.end = max(current.end, end)
                current.reads.append(r)
                continue
            current = _Group(name, r.start, end, [r])
            groups.append(current)
    # Largest first, so the slowest requests start early.
    groups.sort(key=lambda g: g.end - g.start, reverse=True)
    return groups


def _read_whole(reader: CheckpointReader, name: str) -> bytes:
    """One whole file, checked against the manifest's size and CRC32C, in one request: a
    ranged read of the size the manifest records (plus one byte, so a longer file is caught),
    where a plain whole-file read costs object stores a HEAD first."""
    entry = reader.manifest.file(name)
    if entry is None:
        return reader.read_bytes(name)  # raises, naming the files the checkpoint has
    data = reader.read_range(name, 0, entry.size + 1)
    reader.check(name, data)
    return data


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class ZephonStorageReader(StorageReader):
    """Reads a committed checkpoint ``(run, step)`` of ``store`` for ``dcp.load``.

    Construct one on every rank. Every slice the metadata names is checked against the
    manifest's file sizes, and a missing file or a short read raises the storage layer's
    ``CorruptCheckpointError`` naming the file, whatever ``verify`` says.

    ``verify=True`` (the default) also checks every slice this rank reads against the CRC32C
    recorded for it at save time, while its bytes arrive: on local disk each 1 MiB chunk is
    checksummed right after ``readinto`` put it into the destination (still in the CPU
    cache), on object stores the slice is checksummed in the response buffer before it is
    delivered (a slice longer than ``max_request_bytes`` arrives in several ranged GETs, each
    copied into the destination and checksummed on the way, so a reader thread holds one
    request at a time); the checksum runs in the reader threads without the GIL. A mismatch raises
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
        # Local reads land straight in the destination tensors, so gaps are never worth reading.
        self.max_gap_bytes = 0 if local else max_gap_bytes
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
        metadata = decode_metadata(_read_whole(reader, name), where=f"{reader.url}/{name}")
        self._check_slices(metadata, reader)
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

    def _check_slices(self, metadata: Metadata, reader: CheckpointReader) -> None:
        sizes = {entry.name: entry.size for entry in reader.manifest.files}
        problems = []
        items = metadata.state_dict_metadata
        for index, where in (metadata.storage_data or {}).items():
            size = sizes.get(where.file)
            kind = kind_problem(index, where, items.get(index.fqn))
            if kind is not None:
                problems.append(kind)
            elif size is None:
                problems.append(f"{where.file}: not listed by the commit marker ({index.fqn})")
            elif where.offset + where.length > size:
                problems.append(
                    f"{where.file}: {size} bytes, but {index.fqn} needs bytes "
                    f"{where.offset}..{where.offset + where.length}"
                )
            elif where.encoding == "raw":
                expected = (
                    math.prod(where.shape or ()) * dtype_from_name(where.dtype or "").itemsize
                )
                if expected != where.length:
                    problems.append(
                        f"{where.file}: {index.fqn} has {where.length} bytes for shape "
                        f"{list(where.shape or ())} of {where.dtype} ({expected} expected)"
                    )
        if problems:
            raise CorruptCheckpointError(
                f"DCP metadata of {reader.url} does not match its files: "
                f"{'; '.join(problems[:10])}; the checkpoint cannot be loaded: resume from an "
                "earlier checkpoint",
                url=reader.url,
                run=self.run,
                step=self.step,
                path=self.metadata_name,
                problems=problems,
            )

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
            reads.append(_plan_read(req, where, check=self.verify))
        groups = _group_reads(reads, self.max_request_bytes, self.max_gap_bytes)
        local = self.store.location.backend.posix_paths
        run_group: Callable[[_Group, LoadPlanner], None] = (
            self._read_local if local else self._read_remote
        )
        if len(groups) <= 1 or self.thread_count == 1:
            for g in groups:
                run_group(g, planner)
        else:
            workers = min(self.thread_count, len(groups))
            with ThreadPoolExecutor(workers, thread_name_prefix="zephon-dcp-read") as pool:
                futures = [pool.submit(run_group, g, planner) for g in groups]
                first_error: BaseException | None = None
                for f in futures:
                    try:
                        f.result()
                    except BaseException as exc:  # noqa: BLE001 - re-raised once all finished
                        first_error = first_error or exc
                if first_error is not None:
                    raise first_error
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _mismatch(self, r: _Read, crc: int) -> CorruptCheckpointError:
        assert r.crc is not None
        index = r.req.storage_index
        sharded = index.offset is not None and any(index.offset)
        chunk = f" (the chunk at {list(index.offset or [])})" if sharded else ""
        problem = (
            f"{r.file}: crc32c of {index.fqn} is {encode_crc32c(crc)}, the checkpoint says "
            f"{encode_crc32c(r.crc)}"
        )
        return CorruptCheckpointError(
            f"{problem}{chunk}: bytes {r.start}..{r.start + r.length} of {r.file} in committed "
            f"checkpoint {self.url} changed after they were saved, so it cannot be loaded: "
            "resume from an earlier checkpoint (`zephon verify --deep` lists every damaged file)",
            url=self.url,
            run=self.run,
            step=self.step,
            path=r.file,
            problems=[problem],
        )

    def _check(self, r: _Read, crc: int) -> None:
        if r.crc is not None and crc != r.crc:
            raise self._mismatch(r, crc)

    def _short(self, name: str, wanted: int, got: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{name} of committed checkpoint {self.url} is shorter than its manifest says "
            f"(needed bytes up to {wanted}, got {got}); the checkpoint is damaged: run `zephon "
            "verify` and resume from an earlier checkpoint",
            url=self.url,
            run=self.run,
            step=self.step,
            path=name,
            problems=[f"{name}: truncated"],
        )

    def _read_local(self, group: _Group, planner: LoadPlanner) -> None:
        assert self._reader is not None
        with self._reader.open_in_place(group.file) as handle:
            for r in group.reads:
                target = self._target(r, planner)
                if target is not None and self._direct(r, target):
                    if r.length:
                        self._fill(handle, r, _writable_bytes(target))
                    self._commit(r, planner, target)
                    continue
                buffer = bytearray(r.length)
                self._fill(handle, r, memoryview(buffer))
                self._deliver(r, planner, buffer, target)

    def _fill(self, handle: BinaryIO, r: _Read, view: memoryview) -> None:
        """Read ``r``'s bytes into ``view``; when ``r`` is checked, in chunks, each one
        checksummed while the kernel's copy has left it in the CPU cache."""
        handle.seek(r.start)
        got = 0
        chunk = _VERIFY_CHUNK if r.crc is not None else len(view)
        crc = 0
        while got < len(view):
            n = handle.readinto(view[got : got + chunk])
            if not n:
                raise self._short(r.file, r.start + r.length, r.start + got)
            if r.crc is not None:
                crc = crc32c_extend(crc, view[got : got + n])
            got += n
        self._check(r, crc)

    def _read_remote(self, group: _Group, planner: LoadPlanner) -> None:
        assert self._reader is not None
        if group.end - group.start > self.max_request_bytes:
            # Only a single read longer than a request makes such a group (see _group_reads).
            self._stream_remote(group.reads[0], planner)
            return
        data = self._reader.read_range(group.file, group.start, group.end)
        if len(data) != group.end - group.start:
            raise self._short(group.file, group.end, group.start + len(data))
        view = memoryview(data)
        for r in group.reads:
            piece = view[r.start - group.start : r.start - group.start + r.length]
            if r.crc is not None:
                self._check(r, crc32c_extend(0, piece))
            self._deliver(r, planner, piece, self._target(r, planner))

    def _stream_remote(self, r: _Read, planner: LoadPlanner) -> None:
        """Read one slice longer than ``max_request_bytes`` in ranged GETs of at most that
        many bytes, each copied into the destination (or, if the bytes cannot land there as
        they are, into one buffer of the slice) and fed to the running CRC as it arrives: the
        response buffers in flight stay bounded however large the slice, as on local disk."""
        assert self._reader is not None
        target = self._target(r, planner)
        direct = target is not None and self._direct(r, target)
        buffer = None if direct else bytearray(r.length)
        view = _writable_bytes(target) if direct else memoryview(buffer)
        crc = 0
        for begin in range(0, r.length, self.max_request_bytes):
            end = min(begin + self.max_request_bytes, r.length)
            data = self._reader.read_range(r.file, r.start + begin, r.start + end)
            if len(data) != end - begin:
                raise self._short(r.file, r.start + end, r.start + begin + len(data))
            view[begin:end] = data
            del data  # before the next request: one response buffer per thread at a time
            if r.crc is not None:
                crc = crc32c_extend(crc, view[begin:end])
        self._check(r, crc)
        if direct:
            self._commit(r, planner, target)
        else:
            self._deliver(r, planner, buffer, target)

    def _target(self, r: _Read, planner: LoadPlanner) -> torch.Tensor | None:
        if r.dtype is None:
            return None
        with self._lock:
            target = planner.resolve_tensor(r.req).detach()
        if tuple(target.shape) != tuple(r.req.lengths):
            raise StateDictMismatchError(
                f"cannot load {r.req.dest_index.fqn!r}: the destination slice has shape "
                f"{list(target.shape)}, the checkpoint provides {list(r.req.lengths)}: load into "
                "a state shaped as the one saved"
            )
        return target

    @staticmethod
    def _direct(r: _Read, target: torch.Tensor) -> bool:
        """Whether the bytes read can land in ``target``'s memory as they are."""
        return (
            r.narrow is None
            and target.device.type == "cpu"
            and target.dtype == r.dtype
            and target.is_contiguous()
            and target.numel() > 0
        )

    def _deliver(
        self,
        r: _Read,
        planner: LoadPlanner,
        data: bytes | bytearray | memoryview,
        target: torch.Tensor | None,
    ) -> None:
        if target is None:
            deliver_bytes(planner, r.req, data, where=self.url, lock=self._lock)
            return
        assert r.dtype is not None
        if target.numel():
            with warnings.catch_warnings():
                # Read-only buffers are only read from here; torch warns about any of them.
                warnings.simplefilter("ignore", UserWarning)
                source = torch.frombuffer(data, dtype=r.dtype).view(r.shape)
            for dim, (offset, length) in enumerate(r.narrow or ()):
                source = source.narrow(dim, offset, length)
            target.copy_(source)
        self._commit(r, planner, target)

    def _commit(self, r: _Read, planner: LoadPlanner, target: torch.Tensor) -> None:
        with self._lock:
            planner.commit_tensor(r.req, target)
