"""Streaming a local checkpoint's files into a save_dir writer, each checked against its
local manifest entry before the object is completed (docs/tiers.md, "What a save does")."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from zephon.storage import CheckpointWriter, CorruptCheckpointError, FileEntry

__all__ = ["UPLOAD_THREADS", "copy_verified"]

_CHUNK = 8 << 20

#: files one rank uploads at once: each holds about a read chunk and an upload part in memory
UPLOAD_THREADS = 8


def copy_verified(
    files: list[FileEntry],
    local_payload: str,
    writer: CheckpointWriter,
    *,
    threads: int = UPLOAD_THREADS,
) -> None:
    """Stream each local file of ``local_payload`` into ``writer``, ``threads`` files at once,
    refusing one whose bytes are not its entry's (size and CRC32C, checked before the object
    is completed, so a local file damaged on disk is never published). The first failure is
    raised once the files under way have finished; no new file starts after it."""
    if not files:
        return
    failed = threading.Event()

    def copy(entry: FileEntry) -> None:
        if not failed.is_set():
            try:
                _copy_one(entry, local_payload, writer)
            except BaseException:
                failed.set()
                raise

    with ThreadPoolExecutor(
        max(1, min(threads, len(files))), thread_name_prefix="zephon-upload"
    ) as pool:
        futures = [pool.submit(copy, entry) for entry in files]
    for future in futures:
        future.result()


def _copy_one(entry: FileEntry, local_payload: str, writer: CheckpointWriter) -> None:
    path = f"{local_payload}/{entry.name}"
    try:
        source = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"local file {path} of step {writer.step} is missing; it cannot be uploaded",
            run=writer.run,
            step=writer.step,
            problems=[f"{entry.name}: missing"],
        ) from None
    with source, writer.open(entry.name) as out:
        while chunk := source.read(_CHUNK):
            out.write(chunk)
        if out.crc.size != entry.size or out.crc.encoded() != entry.crc32c:
            raise CorruptCheckpointError(
                f"local file {path} of step {writer.step} has {out.crc.size} bytes with "
                f"CRC32C {out.crc.encoded()}, its manifest says {entry.size} bytes "
                f"{entry.crc32c}: the local copy is damaged and is not uploaded",
                run=writer.run,
                step=writer.step,
                problems=[f"{entry.name}: checksum mismatch"],
            )
