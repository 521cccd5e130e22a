"""Performs the read groups of a DCP load and hands their bytes to the planner.

Each group (neighbouring slices of one file, ``zephon.dcp.read_plan``) is one stream of bytes
that lands straight in the destination tensors where dtype and layout allow (else in one buffer
per slice, converted or cut on delivery), through a ``zephon.dcp.landing.Landing``: on local
disk ``os.preadv`` calls of about 1 MiB, each filling the pieces of several tensors at once; on
object stores one ranged GET per group (several when one slice is longer than
``max_request_bytes``) whose reply is streamed and each chunk copied once into place. A checked
slice (one with a recorded CRC32C) is checksummed while its bytes are hot, so no byte reaches the
model unchecked and nothing is read twice. Groups run in parallel threads; the reads and the CRC
release the GIL. Each local file is opened once per load, whatever its number of groups.
"""

from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import torch
from torch.distributed.checkpoint.planner import LoadPlanner

from zephon.dcp.errors import StateDictMismatchError
from zephon.dcp.landing import Landing
from zephon.dcp.load_checks import crc_mismatch_error, short_read_error
from zephon.dcp.read_plan import ReadGroup, SliceRead
from zephon.dcp.untrusted import deliver_bytes
from zephon.storage import CheckpointReader, CorruptCheckpointError

__all__ = ["RangeFetcher"]

#: bytes read into the destination at a time while verifying: small enough that the CRC reads
#: them from the CPU cache the kernel's copy just filled, large enough that syscalls are few
_VERIFY_CHUNK = 1 << 20
#: bytes per ``preadv`` when nothing is checked
_PLAIN_CHUNK = 64 << 20


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
        handles: dict[str, BinaryIO] = {}
        try:
            if self.local:  # each file once, shared by the threads (preadv has no position)
                for name in dict.fromkeys(g.file for g in groups):
                    if self.reader.local_path(name) is not None:  # not a deduplicated file
                        handles[name] = self.reader.open_in_place(name)
            if len(groups) <= 1 or self.thread_count == 1:
                for g in groups:
                    self._read_group(g, planner, handles.get(g.file))
                return
            workers = min(self.thread_count, len(groups))
            with ThreadPoolExecutor(workers, thread_name_prefix="zephon-dcp-read") as pool:
                futures = [
                    pool.submit(self._read_group, g, planner, handles.get(g.file)) for g in groups
                ]
                first_error: BaseException | None = None
                for f in futures:
                    try:
                        f.result()
                    except BaseException as exc:  # noqa: BLE001 - re-raised once all finished
                        first_error = first_error or exc
                if first_error is not None:
                    raise first_error
        finally:
            for handle in handles.values():
                handle.close()

    def _check(self, r: SliceRead, crc: int) -> None:
        if r.crc is not None and crc != r.crc:
            raise crc_mismatch_error(r, crc, url=self.url, run=self.run, step=self.step)

    def _short(self, name: str, wanted: int, got: int) -> CorruptCheckpointError:
        return short_read_error(name, wanted, got, url=self.url, run=self.run, step=self.step)

    def _read_group(self, group: ReadGroup, planner: LoadPlanner, handle: BinaryIO | None) -> None:
        """Land ``group``'s bytes in their destinations and deliver each read once its bytes
        are all there and checked."""
        targets = self._targets(group.reads, planner)
        buffers: list[bytearray | None] = []
        views: list[memoryview] = []
        for r, target in zip(group.reads, targets, strict=True):
            if target is not None and self._direct(r, target):
                buffers.append(None)
                views.append(_writable_bytes(target))
            else:
                buffer = bytearray(r.length)
                buffers.append(buffer)
                views.append(memoryview(buffer))

        def finish(i: int, crc: int) -> None:
            r = group.reads[i]
            self._check(r, crc)
            buffer, target = buffers[i], targets[i]
            if buffer is None:
                assert target is not None
                self._commit(r, planner, target)
            else:
                self._deliver(r, planner, buffer, target)

        landing = Landing(group, views, finish)
        if handle is not None:
            self._pread(handle.fileno(), group, landing)
            return
        for start, end in group.requests(self.max_request_bytes):
            got = self.reader.read_range_stream(group.file, start, end, landing.feed)
            if got != end - start:
                raise self._short(group.file, end, start + got)

    def _pread(self, fd: int, group: ReadGroup, landing: Landing) -> None:
        """``group`` from local disk: ``preadv`` straight into the destinations, about 1 MiB
        at a time when a read is checked (the CRC then reads bytes still in the CPU cache)."""
        checked = any(r.crc is not None for r in group.reads)
        window = _VERIFY_CHUNK if checked else _PLAIN_CHUNK
        reads = group.reads
        gaps = [b.start - a.start - a.length for a, b in zip(reads, reads[1:], strict=False)]
        scratch = memoryview(bytearray(max(gaps, default=0)))  # the bytes between reads
        while not landing.done:
            pieces, _reached = landing.segments(min(landing.pos + window, group.end))
            iov = [view if view is not None else scratch[:n] for view, n in pieces]
            count = os.preadv(fd, iov, landing.pos)
            if not count:
                raise self._short(group.file, group.end, landing.pos)
            landing.landed(count)

    def _targets(self, reads: list[SliceRead], planner: LoadPlanner) -> list[torch.Tensor | None]:
        """The destination tensor of each read (None for a bytes item), resolved under one
        hold of the planner's lock."""
        with self.lock:
            targets = [
                planner.resolve_tensor(r.req).detach() if r.dtype is not None else None
                for r in reads
            ]
        for r, target in zip(reads, targets, strict=True):
            if target is not None and tuple(target.shape) != tuple(r.req.lengths):
                raise StateDictMismatchError(
                    f"cannot load {r.req.dest_index.fqn!r}: the destination slice has shape "
                    f"{list(target.shape)}, the checkpoint provides {list(r.req.lengths)}: load "
                    "into a state shaped as the one saved"
                )
        return targets

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
