"""Performs the read groups of a DCP load and hands their bytes to the planner.

On local disk each range is read with ``readinto`` straight into the destination tensor when
dtype and layout allow; on object stores a group of one slice arrives by ranged GETs straight
into the destination (``read_range_into``: several when the slice is longer than a request),
and a group of neighbouring small items is one GET, each item copied from the reply. A checked slice
(one with a recorded CRC32C) is checksummed while its bytes arrive, so no byte reaches the
model unchecked and nothing is read twice. Groups run in parallel threads; the CRC releases
the GIL.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import torch
from torch.distributed.checkpoint.planner import LoadPlanner

from zephon.dcp.errors import StateDictMismatchError
from zephon.dcp.load_checks import crc_mismatch_error, short_read_error
from zephon.dcp.read_plan import ReadGroup, SliceRead
from zephon.dcp.untrusted import deliver_bytes
from zephon.storage import CheckpointReader, CorruptCheckpointError, crc32c_extend

__all__ = ["RangeFetcher"]

#: bytes read into the destination at a time while verifying: small enough that the CRC reads
#: them from the CPU cache the kernel's copy just filled, large enough that syscalls are few
_VERIFY_CHUNK = 1 << 20


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


@dataclass(slots=True)
class RangeFetcher:
    """Reads groups of one opened checkpoint (``reader``, at ``url``) for one load."""

    reader: CheckpointReader
    url: str
    run: str | None
    step: int | None
    #: whether files are read through the local filesystem (else by ranged requests)
    local: bool
    thread_count: int
    max_request_bytes: int
    #: serialises the calls into the planner, which is not thread-safe
    lock: threading.Lock

    def fetch(self, groups: list[ReadGroup], planner: LoadPlanner) -> None:
        """Read every group, in up to ``thread_count`` threads, and deliver each read to
        ``planner``; the first failure is raised once every started group has finished."""
        run_group: Callable[[ReadGroup, LoadPlanner], None] = (
            self._read_local if self.local else self._read_remote
        )
        if len(groups) <= 1 or self.thread_count == 1:
            for g in groups:
                run_group(g, planner)
            return
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

    def _check(self, r: SliceRead, crc: int) -> None:
        if r.crc is not None and crc != r.crc:
            raise crc_mismatch_error(r, crc, url=self.url, run=self.run, step=self.step)

    def _short(self, name: str, wanted: int, got: int) -> CorruptCheckpointError:
        return short_read_error(name, wanted, got, url=self.url, run=self.run, step=self.step)

    def _read_local(self, group: ReadGroup, planner: LoadPlanner) -> None:
        with self.reader.open_in_place(group.file) as handle:
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

    def _fill(self, handle: BinaryIO, r: SliceRead, view: memoryview) -> None:
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

    def _read_remote(self, group: ReadGroup, planner: LoadPlanner) -> None:
        if len(group.reads) == 1:
            # One slice (however long): its ranged GETs land straight in the destination.
            self._read_one_remote(group.reads[0], planner)
            return
        # Neighbouring small items share one GET; each is cut from the reply (a buffer of
        # the native client's, or bytes) and copied into its destination.
        data = self.reader.read_range(group.file, group.start, group.end)
        view = memoryview(data).cast("B")
        if view.nbytes != group.end - group.start:
            raise self._short(group.file, group.end, group.start + view.nbytes)
        for r in group.reads:
            piece = view[r.start - group.start : r.start - group.start + r.length]
            if r.crc is not None:
                self._check(r, crc32c_extend(0, piece))
            self._deliver(r, planner, piece, self._target(r, planner))

    def _read_one_remote(self, r: SliceRead, planner: LoadPlanner) -> None:
        """Read one slice in ranged GETs of at most ``max_request_bytes``, each landing straight
        in the destination tensor's memory (``read_range_into``; or, if the bytes cannot land
        there as they are, in one buffer of the slice) and fed to the running CRC there, once:
        no bytes object per request, and the replies in flight stay bounded however large the
        slice, as on local disk."""
        target = self._target(r, planner)
        direct = target is not None and self._direct(r, target)
        buffer = None if direct else bytearray(r.length)
        view = _writable_bytes(target) if direct else memoryview(buffer)
        crc = 0
        for begin in range(0, r.length, self.max_request_bytes):
            end = min(begin + self.max_request_bytes, r.length)
            got = self.reader.read_range_into(r.file, r.start + begin, view[begin:end])
            if got != end - begin:
                raise self._short(r.file, r.start + end, r.start + begin + got)
            if r.crc is not None:
                crc = crc32c_extend(crc, view[begin:end])
        self._check(r, crc)
        if direct:
            self._commit(r, planner, target)
        else:
            self._deliver(r, planner, buffer, target)

    def _target(self, r: SliceRead, planner: LoadPlanner) -> torch.Tensor | None:
        if r.dtype is None:
            return None
        with self.lock:
            target = planner.resolve_tensor(r.req).detach()
        if tuple(target.shape) != tuple(r.req.lengths):
            raise StateDictMismatchError(
                f"cannot load {r.req.dest_index.fqn!r}: the destination slice has shape "
                f"{list(target.shape)}, the checkpoint provides {list(r.req.lengths)}: load into "
                "a state shaped as the one saved"
            )
        return target

    @staticmethod
    def _direct(r: SliceRead, target: torch.Tensor) -> bool:
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
        r: SliceRead,
        planner: LoadPlanner,
        data: bytes | bytearray | memoryview,
        target: torch.Tensor | None,
    ) -> None:
        if target is None:
            deliver_bytes(planner, r.req, data, where=self.url, lock=self.lock)
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

    def _commit(self, r: SliceRead, planner: LoadPlanner, target: torch.Tensor) -> None:
        with self.lock:
            planner.commit_tensor(r.req, target)
