"""Writing a deduplicated file: its bytes cut into content-addressed chunks, each uploaded
only if the save's base does not hold the same content already (``storage/chunks.py``).

``SaveChunks`` is one save's view of the run's chunks: what its base offers (by SHA-256), what
the save uploaded itself, and the uploads in flight. Every file of the save written with
``CheckpointWriter.open_chunked`` goes through it, from any thread. ``ChunkedFile`` is one such
file: ``write`` takes the same arguments as ``RecordingFile.write``, cuts what it is given at
``max_chunk`` bytes, and hands each piece to a pool thread that hashes it and uploads it, or
refers to the base's instance. The hashing and the uploads of one file overlap with the
writer producing its next bytes; at most ``in_flight`` pieces of a file are pending at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from zephon.storage.checksum import Crc32c, crc32c_extend, encode_crc32c
from zephon.storage.chunks import DEFAULT_MAX_CHUNK, ChunkRef
from zephon.storage.location import Location

__all__ = ["ChunkedFile", "SaveChunks"]

#: pieces of one file hashed or uploading at once (each a view of the caller's memory)
DEFAULT_IN_FLIGHT = 8


class SaveChunks:
    """One save's chunks: the base's instances by content, and this save's own uploads.

    ``base`` maps a SHA-256 (hex) to an instance the save may list without uploading: the
    chunks of the newest committed checkpoint of the save's history, which retention never
    deletes while it is the newest (docs/dedup.md). Anything else is uploaded as
    ``<sha256>.<save_id>``, once per save however many files hold it.
    """

    def __init__(
        self,
        location: Location,
        chunk_dir: str,
        save_id: str,
        base: Mapping[str, ChunkRef],
        *,
        part_size: int,
        max_chunk: int = DEFAULT_MAX_CHUNK,
    ) -> None:
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be at least 1 byte, not {max_chunk}")
        self._location = location
        self.chunk_dir = chunk_dir
        self.save_id = save_id
        self._base = dict(base)
        self._part_size = part_size
        self.max_chunk = max_chunk
        self._lock = threading.Lock()
        self._own: dict[str, Future[ChunkRef]] = {}
        self._dir_made = False
        #: bytes this save uploaded (each chunk once) and bytes it found in its base
        self.uploaded_bytes = 0
        self.reused_bytes = 0

    @property
    def uploaded(self) -> list[str]:
        """The chunk instances this save uploaded (paths), for an abort to remove."""
        with self._lock:
            done = [f for f in self._own.values() if f.done() and f.exception() is None]
        return [f"{self.chunk_dir}/{f.result().name}" for f in done]

    def place(self, view: memoryview, crc: int) -> ChunkRef:
        """Hash ``view`` and upload it unless its content is known (in the base, or uploaded
        by this save already); the reference the manifest lists."""
        sha = hashlib.sha256(view).hexdigest()
        size = view.nbytes
        with self._lock:
            known = self._base.get(sha)
            if known is not None and known.size == size:
                self.reused_bytes += size
                return known
            pending = self._own.get(sha)
            if pending is None:
                pending = Future()
                self._own[sha] = pending
                mine = True
            else:
                mine = False
        if not mine:
            ref = pending.result()  # the same content uploaded by another piece of this save
            return ref
        ref = ChunkRef(sha, self.save_id, size, encode_crc32c(crc))
        try:
            self._make_dir()
            self._location.backend.put_buffer(
                f"{self.chunk_dir}/{ref.name}", view, self._part_size, ref.crc32c
            )
        except BaseException as exc:
            with self._lock:
                self._own.pop(sha, None)
            pending.set_exception(exc)
            raise
        with self._lock:
            self.uploaded_bytes += size
        pending.set_result(ref)
        return ref

    def _make_dir(self) -> None:
        if self._dir_made or not self._location.backend.has_directories:
            return
        self._location.backend.make_dirs(self.chunk_dir)
        self._dir_made = True


class ChunkedFile:
    """One deduplicated file being written: the same ``write`` as ``RecordingFile``; its
    entry's chunks come from ``finish``."""

    def __init__(self, chunks: SaveChunks, *, in_flight: int = DEFAULT_IN_FLIGHT) -> None:
        """``in_flight``: pieces hashed or uploading at once, in this file's own threads (the
        writer waits for room, so they are never a pool the writer itself runs in)."""
        self._chunks = chunks
        self._slots = threading.BoundedSemaphore(max(1, in_flight))
        self._pool = ThreadPoolExecutor(max(1, in_flight), thread_name_prefix="zephon-chunk")
        self._pending: list[Future[ChunkRef]] = []
        self.crc = Crc32c()

    def write(
        self,
        data: bytes | bytearray | memoryview,
        crc: int | None = None,
        *,
        in_place: bool = False,
    ) -> int:
        """Add ``data`` to the file; returns its length. ``crc`` (the CRC32C of exactly
        ``data``) is combined into the file's CRC when ``data`` is one chunk; ``in_place``
        promises that ``data`` stays unchanged until ``finish`` (else it is copied once)."""
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if not in_place:
            view = memoryview(bytes(view))
        size = view.nbytes
        step = self._chunks.max_chunk
        for start in range(0, size, step):
            piece = view[start : start + step]
            piece_crc = crc if crc is not None and piece.nbytes == size else None
            if piece_crc is None:
                piece_crc = crc32c_extend(0, piece)
            self.crc.extend(piece_crc, piece.nbytes)
            self._slots.acquire()
            try:
                future = self._pool.submit(self._chunks.place, piece, piece_crc)
            except BaseException:
                self._slots.release()
                raise
            future.add_done_callback(lambda _f: self._slots.release())
            self._pending.append(future)
        return size

    def finish(self) -> tuple[ChunkRef, ...]:
        """Wait for every piece; the file's chunk references in order. The first failure is
        raised once every piece has finished or failed."""
        refs, first_error = [], None
        for future in self._pending:
            try:
                refs.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised once all finished
                first_error = first_error or exc
        self._pool.shutdown(wait=True)
        if first_error is not None:
            raise first_error
        return tuple(refs)

    def discard(self) -> None:
        """Wait for the pieces in flight (their views must outlive them); what they uploaded
        is an unreferenced chunk, removed by the next sweep."""
        for future in self._pending:
            with contextlib.suppress(BaseException):  # the save is failing already
                future.result()
        self._pool.shutdown(wait=True)
