"""Writing one checkpoint's payload and committing it with the marker.

A ``CheckpointWriter`` is made by ``RunStore.begin`` (the primary writer, the only one
that may commit) or ``RunStore.attach`` (a secondary writer, e.g. another rank writing
its own shards into the same checkpoint; its entries reach the primary through
``add_entries``). Size and CRC32C of every file are recorded while the bytes go out, never by
reading them back. It holds the location, the run's layout, its fence and the store's thread
pool (as a factory), never the store itself.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from typing import Any, BinaryIO

from zephon.storage.backend import (
    copy_file,
    create_settled,
    file_exists,
    list_files,
    make_dirs,
    open_read,
    outcome_unknown,
    remove_dir,
    remove_empty_dirs,
    remove_files,
    same_store,
    sync_dirs,
)
from zephon.storage.checksum import Crc32c
from zephon.storage.errors import (
    BackendUnavailableError,
    CommitConflictError,
    InvalidNameError,
    WriteAbortedError,
)
from zephon.storage.existing import check_fence, supersede
from zephon.storage.layout import MARKER_NAME, RunLayout, validate_file_name
from zephon.storage.lineage import Fence
from zephon.storage.location import Location
from zephon.storage.manifest import FileEntry, Manifest, validate_save_id
from zephon.storage.markers import describe_commit
from zephon.storage.parallel import concurrently
from zephon.storage.recording import ChecksummedReader, RecordingFile

__all__ = ["CheckpointWriter", "Payload"]

#: What ``write_many`` accepts per file: bytes-like data, a local file path, or a readable stream.
Payload = bytes | bytearray | memoryview | str | os.PathLike | BinaryIO

_CHUNK = 8 << 20
#: how often a commit supersedes a stale marker that appeared at its step before giving up
_COMMIT_TRIES = 5


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


class CheckpointWriter:
    """Writes one save of ``<root>/<run>/save-<step>/`` and commits it.

    Files go to the save's own payload directory, ``save-<step>/<save_id>/``: no other save
    (another attempt's, or an earlier try of this step) ever writes a file this save's manifest
    lists, so a late write by a stale attempt is garbage at worst, never corruption. A fenced
    writer carries its attempt's ``Fence``; the commit re-checks it just before the marker.

    Thread-safe: files may be written from many threads at once. Not process-safe by itself:
    other processes write through their own ``attach``-ed writer and hand over their entries.
    """

    def __init__(
        self,
        location: Location,
        layout: RunLayout,
        step: int,
        save_id: str,
        *,
        primary: bool,
        part_size: int,
        executor: Callable[[], Executor],
        fence: Fence | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """``part_size``: bytes per multipart part; ``executor``: the store's thread pool,
        made on first use (``write_many``)."""
        self._location = location
        self._layout = layout
        self._part_size = part_size
        self._executor = executor
        self.run = layout.run
        self.step = step
        self.save_id = validate_save_id(save_id)
        self.primary = primary
        self.fence = fence
        #: the step directory (``save-<step>``) and its URL, as messages and DCP name it
        self.path = layout.checkpoint_path(step)
        self.url = location.display(self.path)
        #: where this save's files go
        self.payload_path = layout.payload_path(step, self.save_id)
        self._metadata = dict(metadata or {})
        self._entries: dict[str, FileEntry] = {}
        self._own: set[str] = set()  # names this writer wrote itself (not add_entries)
        self._lock = threading.Lock()
        self._dirs: set[str] = {self.payload_path, self.path}
        self._state = "open"
        #: a marker request of this save went out and may have been applied (or may still be)
        self._marker_may_exist = False
        self._sent: Manifest | None = None  # the manifest the marker requests carry
        self._present_only = False  # keep_present_only()
        self._created_at = _now()
        #: the committed manifest, once ``commit`` succeeded
        self.manifest: Manifest | None = None

    # -- writing -------------------------------------------------------------------------------

    @property
    def entries(self) -> list[FileEntry]:
        """Every file this writer knows about, its own and those added from other writers."""
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.name)

    def write_bytes(self, name: str, data: bytes | bytearray | memoryview) -> FileEntry:
        """Write one file from memory."""
        target = self._claim(name)
        location = self._location
        with self._guard(name):
            if location.backend.posix_paths:
                # An OS file: written and checksummed in writeback pieces, while they are hot.
                with self._open_file(target) as out:
                    out.write(data)
                return self._record(name, out.crc)
            crc = Crc32c()
            crc.update(data)
            # the caller's buffer as it is (no copy where the backend reads it in place), and
            # the CRC32C for the store to check where it can
            location.backend.put_buffer(target, data, self._part_size, crc.encoded())
            return self._record(name, crc)

    def write_stream(self, name: str, stream: BinaryIO) -> FileEntry:
        """Write one file from a readable binary stream, in bounded-memory chunks."""
        with self.open(name) as out:
            while chunk := stream.read(_CHUNK):
                out.write(chunk)
        return self._entries[name]

    def put_file(self, name: str, local_path: str | os.PathLike) -> FileEntry:
        """Copy one local file into the checkpoint."""
        with open(local_path, "rb") as stream:
            return self.write_stream(name, stream)

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[RecordingFile]:
        """A file to ``write()`` into; recorded in the manifest when the block exits cleanly.

        Large files on object stores go out as multipart uploads as the buffer fills.
        """
        target = self._claim(name)
        with self._guard(name):
            with self._open_file(target) as out:
                yield out
            self._record(name, out.crc)

    def can_copy_from(self, source: Location) -> bool:
        """Whether ``copy_from`` can copy files of ``source`` into this save on the server."""
        return same_store(self._location, source)

    def copy_from(
        self,
        source: Location,
        path: str,
        name: str,
        size: int,
        read: Callable[[BinaryIO], None] | None = None,
    ) -> FileEntry:
        """Copy the file ``path`` of ``source`` (``size`` bytes) into this save as ``name`` on
        the server (only where ``can_copy_from``), then read the copy back once for its size
        and CRC32C: what the manifest records are the copy's own bytes. ``read``, if given,
        gets that stream first, from its start (e.g. to parse the file on the way).
        ``WriteAbortedError`` if the copy does not hold ``size`` bytes."""
        target = self._claim(name)
        location = self._location
        with self._guard(name):
            copy_file(location, path, target)
            with open_read(location, target, size) as handle:
                stream = ChecksummedReader(handle)
                if read is not None:
                    read(stream)
                while stream.read(_CHUNK):
                    pass
            if stream.crc.size != size:
                raise WriteAbortedError(
                    f"copy of {source.display(path)} into {self.url} holds {stream.crc.size} "
                    f"bytes, not {size}: the source changed while it was copied; copy again",
                    run=self.run,
                    step=self.step,
                )
            return self._record(name, stream.crc)

    def write_many(self, files: Mapping[str, Payload]) -> list[FileEntry]:
        """Write several files in parallel on the store's thread pool; returns their entries.

        On the first failure the remaining writes still finish or fail, then the first error
        is raised; the checkpoint stays uncommitted either way.
        """
        pool = self._executor()
        futures = [pool.submit(self._write_any, name, payload) for name, payload in files.items()]
        results, first_error = [], None
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below after all finish
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

    def keep_present_only(self) -> None:
        """From now on ``add_entries`` keeps only the entries whose file is in this save's
        payload directory as this writer sees it, so the marker lists the files present on
        this storage and no others. For a payload directory that is not shared by every
        writer (a local disk per node, whose other writers' files go elsewhere); the commit
        still checks that every listed file is there. Costs one existence check per entry."""
        self._present_only = True

    def add_entries(self, entries: Iterable[FileEntry]) -> None:
        """Include files that another writer (another process or rank) wrote into this step
        (only those present here after ``keep_present_only``)."""
        self._check_open()
        entries = list(entries)
        for entry in entries:
            validate_file_name(entry.name)
        if self._present_only:
            location = self._location
            entries = [e for e in entries if file_exists(location, f"{self.payload_path}/{e.name}")]
        with self._lock:
            for entry in entries:
                known = self._entries.get(entry.name)
                if known is not None and known != entry:
                    raise InvalidNameError(
                        f"file {entry.name!r} of {self.url} was reported twice with different "
                        "sizes or checksums: two writers wrote the same name; give each rank "
                        "its own file names",
                        run=self.run,
                        step=self.step,
                        path=entry.name,
                    )
                self._entries[entry.name] = entry

    # -- commit / abort ------------------------------------------------------------------------

    def commit(self, metadata: Mapping[str, Any] | None = None) -> Manifest:
        """Make the checkpoint complete: check the payload with one listing and re-check the
        fence (one listing of the attempt records) at the same time, then, once both passed,
        create the marker exclusively. Only the primary writer may call this, once.

        Idempotent against lost replies: a marker request applied whose answer never came
        back is settled by reading the marker back, and this save's own marker (the very
        bytes this commit sent) means the commit succeeded.

        Raises ``CommitConflictError`` if the step is already committed (by anyone else),
        ``WriteAbortedError`` if a file this writer recorded is missing from storage (it wins
        over the other refusals) and ``FencedOutError`` if a newer attempt registered.
        ``BackendUnavailableError`` after the marker was sent means its outcome is unknown:
        the payload is kept (``abort`` removes nothing) and the marker decides; calling
        ``commit`` again settles it, sending (or finding) the very same marker (``metadata``
        is then that of the first call).
        """
        if self._state == "unknown" and self._sent is not None:
            manifest = self._sent  # settle the earlier call: the very same marker, found or sent
        else:
            manifest = self._prepare(metadata)
        self._sent = manifest
        data = manifest.to_json()
        for _ in range(_COMMIT_TRIES):
            existing = self._create_marker(data)
            if existing is None:
                break
            # Another writer's marker holds the step. A stale attempt's marker (its epoch is
            # not in this fence's lineage) or a damaged one is superseded and the commit tried
            # again; anything else is a real conflict.
            self._state = "lost"
            if self.fence is None:
                holder = describe_commit(self._location, self._layout, self.step, marker=existing)
                raise CommitConflictError(
                    f"{self.url} is already committed{holder}; a committed step is never "
                    "overwritten: save under a new step, or delete that checkpoint first",
                    url=self.url,
                    run=self.run,
                    step=self.step,
                )
            # or raises
            supersede(self._location, self._layout, self.step, self.fence, marker=existing)
            self._state = "open"
        else:
            self._state = "lost"
            raise CommitConflictError(
                f"{self.url} kept getting new markers while this save committed; check for "
                "several jobs saving this run",
                url=self.url,
                run=self.run,
                step=self.step,
            )
        self._state = "committed"
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Remove what was written. The primary removes its save's payload directory (never
        another save's files, never a marker); a secondary removes only its own files.

        Once the commit sent its marker, the primary removes nothing unless the commit learned
        for certain that no marker of this save exists or can still appear (another writer's
        marker answered every request): a marker whose reply was lost names this payload.
        What is kept is a leftover for gc, which removes it once no marker names it.
        """
        if self._state == "committed":
            return
        if self.primary and self._marker_may_exist:
            self._state = "aborted"
            return
        location = self._location
        if self.primary:
            remove_files(location, [f.path for f in list_files(location, self.payload_path)])
            remove_empty_dirs(location, self.payload_path)
            remove_dir(location, self.path)  # only if nothing else is in it
        else:
            with self._lock:
                own = [f"{self.payload_path}/{n}" for n in self._own]
            remove_files(location, own)
        self._state = "aborted"

    def _prepare(self, metadata: Mapping[str, Any] | None) -> Manifest:
        """The checks before a marker (payload listing and fence re-check, sent together) and
        the manifest the marker will hold."""
        self._check_open()
        if not self.primary:
            raise WriteAbortedError(
                f"only the primary writer (RunStore.begin) may commit {self.url}; hand "
                "this writer's entries to it with add_entries()",
                run=self.run,
                step=self.step,
            )
        location = self._location
        entries = self.entries
        sync_dirs(location, sorted(self._dirs, key=len, reverse=True))  # local disk: fsync
        # The payload listing and the fence re-check are independent: they go out together
        # and the marker goes out only once both passed (a missing file is reported first).
        # The re-check narrows the window in which a stale attempt can still publish a
        # marker; readers ignore one that slips through (its epoch is not in the lineage).
        checks = [functools.partial(self._check_payload_present, entries)]
        if self.fence is not None:
            checks.append(functools.partial(check_fence, self._location, self._layout, self.fence))
        concurrently(*checks)
        return Manifest(
            run=self.run,
            step=self.step,
            save_id=self.save_id,
            files=tuple(entries),
            epoch=self.fence.epoch if self.fence is not None else 0,
            attempt_id=self.fence.attempt_id if self.fence is not None else "",
            payload=self.save_id,
            writer={"host": socket.gethostname(), "pid": os.getpid()},
            metadata={**self._metadata, **dict(metadata or {})},
            created_at=self._created_at,
            committed_at=_now(),
        )

    def _create_marker(self, data: bytes) -> bytes | None:
        """Create the marker holding ``data``, settling a lost reply by reading it back
        (``create_settled``): None once this save's marker is there, else another writer's
        marker bytes. Until the outcome is known for certain, ``abort`` keeps the payload."""
        location = self._location
        marker = self._layout.marker_path(self.step)
        earlier = self._marker_may_exist
        self._marker_may_exist = True
        try:
            outcome = create_settled(location, marker, data)
        except FileExistsError:
            self._state = "lost"
            raise CommitConflictError(
                f"creating the marker of {self.url} was refused as existing, yet no marker "
                "could be read there; check for another job saving this run (on a POSIX "
                f"mount, remove a {MARKER_NAME}.claim file a crashed writer left)",
                url=self.url,
                run=self.run,
                step=self.step,
            ) from None
        except BackendUnavailableError as exc:
            self._state = "unknown"
            if not outcome_unknown(exc):
                raise  # refused, not applied; the payload is kept all the same (simpler, safe)
            raise BackendUnavailableError(
                f"{exc}; whether the marker of {self.url} was created is unknown, so its files "
                "are kept: a resume reads the marker to know, and `zephon gc` removes the "
                "files if no marker names them",
                url=exc.url,
                run=self.run,
                step=self.step,
            ) from exc
        except BaseException:
            self._state = "unknown"
            raise
        if outcome.created:
            return None
        # Another writer's marker answered: this save's marker is not there, and none of its
        # requests can still land unless one of them failed without an answer.
        self._marker_may_exist = earlier or outcome.unknown_outcomes > 0
        return outcome.existing

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._state in {"open", "lost"}:
            with contextlib.suppress(Exception):
                self.abort()

    # -- internals -----------------------------------------------------------------------------

    def _write_any(self, name: str, payload: Payload) -> FileEntry:
        if isinstance(payload, bytes | bytearray | memoryview):
            return self.write_bytes(name, payload)
        if isinstance(payload, str | os.PathLike):
            return self.put_file(name, payload)
        return self.write_stream(name, payload)

    def _check_open(self) -> None:
        if self._state != "open":
            raise WriteAbortedError(
                f"writer for {self.url} is {self._state}; begin a new checkpoint to write again",
                run=self.run,
                step=self.step,
            )

    def _claim(self, name: str) -> str:
        self._check_open()
        validate_file_name(name)
        with self._lock:
            if name in self._own or name in self._entries:
                raise InvalidNameError(
                    f"file {name!r} was already written to {self.url}; each name is written once",
                    run=self.run,
                    step=self.step,
                    path=name,
                )
            self._own.add(name)
        target = f"{self.payload_path}/{name}"
        location = self._location
        if location.backend.has_directories:
            parent = target.rsplit("/", 1)[0]
            make_dirs(location, parent)
            with self._lock:  # the directories whose entries the commit makes durable
                while parent.startswith(self.payload_path) and parent not in self._dirs:
                    self._dirs.add(parent)
                    parent = parent.rsplit("/", 1)[0]
        return target

    @contextlib.contextmanager
    def _guard(self, name: str) -> Iterator[None]:
        """On failure, forget the claimed name so the caller may retry it (the backend
        translated the failure)."""
        try:
            yield
        except BaseException:
            with self._lock:
                self._own.discard(name)
                self._entries.pop(name, None)
            raise

    def _record(self, name: str, crc: Crc32c) -> FileEntry:
        entry = FileEntry(name=name, size=crc.size, crc32c=crc.encoded())
        with self._lock:
            self._entries[name] = entry
        return entry

    @contextlib.contextmanager
    def _open_file(self, target: str) -> Iterator[RecordingFile]:
        """The payload file ``target`` open for writing through the backend: completed (local
        disk: fsynced; object stores: the upload finished) when the block exits cleanly,
        abandoned without publishing anything otherwise."""
        backend = self._location.backend
        part_size = self._part_size
        out = RecordingFile(backend.open_write(target, part_size), backend, part_size)
        try:
            yield out
        except BaseException:
            out.discard()
            raise
        out.finish()

    def _check_payload_present(self, entries: list[FileEntry]) -> None:
        location = self._location
        listed = {f.path: f.size for f in list_files(location, self.payload_path)}
        prefix = f"{self.payload_path}/"
        problems = []
        for entry in entries:
            size = listed.get(prefix + entry.name)
            if size is None:
                problems.append(f"{entry.name}: missing")
            elif size != entry.size:
                problems.append(f"{entry.name}: {size} bytes on storage, {entry.size} written")
        if problems:
            self._state = "failed"
            raise WriteAbortedError(
                f"refusing to commit {self.url}: {len(problems)} written file(s) are not on "
                f"storage as written ({'; '.join(problems[:5])}); is another job saving the "
                "same run and step? Save again once only one writer is left",
                run=self.run,
                step=self.step,
            )
