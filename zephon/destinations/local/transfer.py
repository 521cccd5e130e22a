"""Streaming a local checkpoint's files into a save_dir writer, each checked against its
local manifest entry before the object is completed (docs/tiers.md, "What a save does").

With a ``dedup.DedupPlan`` the shard files go out as content-addressed chunks instead
(``CheckpointWriter.open_chunked``, the writer deduplicating against the plan's base), cut
where the plan says; their CRC32C is checked the same way, before the entry is recorded.

A tier's own copy is plain files: an entry that lists chunks is refused here, by name, rather
than read as a missing file.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING

from zephon.storage import CheckpointWriter, CorruptCheckpointError, Crc32c, FileEntry

if TYPE_CHECKING:
    from zephon.destinations.local.dedup import DedupPlan

__all__ = ["UPLOAD_THREADS", "VerifiedSource", "copy_verified", "verified_sources"]

_CHUNK = 8 << 20

#: files one rank uploads at once: each holds about a read chunk and an upload part in memory
UPLOAD_THREADS = 8
#: with a ``DedupPlan``: files one rank uploads at once, each with up to 8 pieces (of up to
#: 8 MiB) hashing or uploading in its own threads, so at most 128 MiB of a rank's memory
CHUNKED_THREADS = 2


def copy_verified(
    files: list[FileEntry],
    local_payload: str,
    writer: CheckpointWriter,
    *,
    threads: int = UPLOAD_THREADS,
    plan: DedupPlan | None = None,
) -> None:
    """Stream each local file of ``local_payload`` into ``writer``, ``threads`` files at once,
    refusing one whose bytes are not its entry's (size and CRC32C, checked before the object
    is completed, so a local file damaged on disk is never published). The first failure is
    raised once the files under way have finished; no new file starts after it. ``plan``:
    the shard files go out as chunks, cut where it says (``writer.deduplicate`` called)."""
    if not files:
        return
    if plan is not None:
        threads = min(threads, CHUNKED_THREADS)
    failed = threading.Event()

    def copy(entry: FileEntry) -> None:
        if not failed.is_set():
            try:
                _copy_one(entry, local_payload, writer, plan)
            except BaseException:
                failed.set()
                raise

    with ThreadPoolExecutor(
        max(1, min(threads, len(files))), thread_name_prefix="zephon-upload"
    ) as pool:
        futures = [pool.submit(copy, entry) for entry in files]
    for future in futures:
        future.result()


def verified_sources(
    files: list[FileEntry], local_payload: str, writer: CheckpointWriter
) -> dict[str, VerifiedSource]:
    """The local files of ``local_payload`` as streams for ``writer.commit(files=...)``: each
    refuses, at its end, bytes that are not its entry's, so the upload is abandoned before
    it completes, as ``copy_verified`` does (it checks the writer's own CRC32C; these compute
    one more, in the reading thread)."""
    return {e.name: VerifiedSource(f"{local_payload}/{e.name}", e, writer) for e in files}


class VerifiedSource:
    """A local file read once, front to back, whose last read (the empty one) raises
    ``CorruptCheckpointError`` if the bytes read were not ``entry``'s size and CRC32C. Opened
    at the first read, so a missing file fails its own upload."""

    def __init__(self, path: str, entry: FileEntry, writer: CheckpointWriter) -> None:
        self.path, self.entry, self._writer = path, entry, writer
        self._file: IO[bytes] | None = None
        self._crc = Crc32c()

    def read(self, size: int = -1) -> bytes:
        if self._file is None:
            self._file = _open_local(self.path, self.entry, self._writer)
        data = self._file.read(size)
        if data:
            self._crc.update(data)
        else:
            self.close()
            _check(self.path, self.entry, self._writer, self._crc)
        return data

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _open_local(path: str, entry: FileEntry, writer: CheckpointWriter) -> IO[bytes]:
    if entry.chunks is not None:
        raise CorruptCheckpointError(
            f"local file {path} of step {writer.step} is listed as chunks by its local marker; "
            "a tier holds plain files only, so it cannot be uploaded",
            run=writer.run,
            step=writer.step,
            problems=[f"{entry.name}: listed as chunks in a tier"],
        )
    try:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"local file {path} of step {writer.step} is missing; it cannot be uploaded",
            run=writer.run,
            step=writer.step,
            problems=[f"{entry.name}: missing"],
        ) from None


def _check(path: str, entry: FileEntry, writer: CheckpointWriter, crc: Crc32c) -> None:
    if crc.size != entry.size or crc.encoded() != entry.crc32c:
        raise CorruptCheckpointError(
            f"local file {path} of step {writer.step} has {crc.size} bytes with "
            f"CRC32C {crc.encoded()}, its manifest says {entry.size} bytes "
            f"{entry.crc32c}: the local copy is damaged and is not uploaded",
            run=writer.run,
            step=writer.step,
            problems=[f"{entry.name}: checksum mismatch"],
        )


def _copy_one(
    entry: FileEntry, local_payload: str, writer: CheckpointWriter, plan: DedupPlan | None
) -> None:
    path = f"{local_payload}/{entry.name}"
    pieces = plan.cut(entry) if plan is not None else None
    if pieces is None:
        with _open_local(path, entry, writer) as source, writer.open(entry.name) as out:
            while chunk := source.read(_CHUNK):
                out.write(chunk)
            _check(path, entry, writer, out.crc)
        return
    with _open_local(path, entry, writer) as source, writer.open_chunked(entry.name) as chunked:
        for size in pieces:  # each piece one chunk (a read's bytes are never changed after)
            if piece := source.read(size):
                chunked.write(piece, in_place=True)
        while rest := source.read(_CHUNK):  # a local file longer than its entry: refused below
            chunked.write(rest, in_place=True)
        _check(path, entry, writer, chunked.crc)
