"""One checkpoint written and committed with the marker.

A ``CheckpointWriter`` is made by ``RunStore.begin`` (the primary writer, the only one
that may commit) or ``RunStore.attach`` (a secondary writer, e.g. another rank writing
its own shards into the same checkpoint; its entries reach the primary through
``add_entries``). Writing files is ``storage.payload_writer``'s half (size and CRC32C recorded
while the bytes go out, never by reading them back); this module adds the entries of other
writers, the commit and ``abort``. It holds the location, the run's layout, its fence and the
store's thread pool (as a factory), never the store itself.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future
from typing import Any

from zephon.storage.backend import (
    create_settled,
    file_exists,
    list_files,
    outcome_unknown,
    remove_dir,
    remove_empty_dirs,
    remove_files,
    sync_dirs,
)
from zephon.storage.chunks import LEASE_DIR, lease_body
from zephon.storage.errors import (
    BackendUnavailableError,
    CommitConflictError,
    InvalidArgumentError,
    InvalidNameError,
    WriteAbortedError,
)
from zephon.storage.existing import check_fence, supersede
from zephon.storage.layout import MARKER_NAME, RunLayout, validate_file_name
from zephon.storage.lineage import Fence
from zephon.storage.location import Location
from zephon.storage.manifest import (
    MAX_INLINE_BYTES,
    MAX_INLINE_FILE,
    FileEntry,
    Manifest,
    inline_copy,
)
from zephon.storage.markers import describe_commit, marker_bytes, parse_marker
from zephon.storage.parallel import concurrently
from zephon.storage.payload_writer import Payload, PayloadWriter

__all__ = ["CheckpointWriter", "Payload"]

#: how often a commit supersedes a stale marker that appeared at its step before giving up
_COMMIT_TRIES = 5


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


class CheckpointWriter(PayloadWriter):
    """Writes one save of ``<root>/<run>/save-<step>/`` and commits it.

    Files go to the save's own payload directory, ``save-<step>/<save_id>/``: no other save
    (another attempt's, or an earlier try of this step) ever writes a file this save's manifest
    lists, so a late write by a stale attempt is garbage at worst, never corruption. A fenced
    writer carries its attempt's ``Fence``; the commit re-checks it before the marker.

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
        super().__init__(location, layout, step, save_id, part_size=part_size, executor=executor)
        self.primary = primary
        self.fence = fence
        self._metadata = dict(metadata or {})
        #: a marker request of this save went out and may have been applied (or may still be)
        self._marker_may_exist = False
        self._sent: Manifest | None = None  # the manifest the marker requests carry
        self._present_only = False  # keep_present_only()
        self._created_at = _now()
        self._base: Manifest | None = None  # keep_base()
        self._lease: Future[None] | None = None
        self._lease_path: str | None = None
        #: the committed manifest, once ``commit`` succeeded
        self.manifest: Manifest | None = None

    # -- other writers' files ------------------------------------------------------------------

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

    def keep_base(self, base: Manifest, *, scope: str = "run") -> None:
        """This save lists chunks of ``base`` (a deduplicated save storing its chunks in
        ``scope``; docs/dedup.md). A lease naming the base's uploaders goes out at once, in the
        background, into the scope's chunk directory: a sweep spares what a young lease names.
        The commit then waits for the lease and re-reads the base's marker, beside the fence
        re-check, and refuses to commit if it is gone or another save's: either a sweep saw
        the lease, or this save sees the base gone. The lease is removed after the commit."""
        self._base = base
        uploaders = {chunk.save_id for chunk in base.chunk_refs()}
        if not uploaders:
            return
        directory = self._location.chunk_dir(scope, self.run)
        self._lease_path = f"{directory}/{LEASE_DIR}/{self.save_id}.json"
        backend, path, body = (
            self._location.backend,
            self._lease_path,
            lease_body(self.save_id, uploaders),
        )

        def write() -> None:
            if backend.has_directories:
                backend.make_dirs(f"{directory}/{LEASE_DIR}", durable=True)
            backend.put_bytes(path, body, self._part_size)

        self._lease = self._executor().submit(write)

    # -- commit / abort ------------------------------------------------------------------------

    def commit(
        self,
        metadata: Mapping[str, Any] | None = None,
        *,
        files: Mapping[str, Payload] | None = None,
        inline: Iterable[str] = (),
    ) -> Manifest:
        """Make the checkpoint complete: write ``files`` (the save's last files, if any), and
        at the same time re-check the fence (one listing of the attempt records) and list the
        payload for the files written before them; then, once all of it succeeded, create the
        marker exclusively. Only the primary writer may call this, once.

        Passing the last files here instead of to ``write_many`` saves a round trip: their
        uploads, the fence re-check and the payload listing go out as one wave. A file of
        ``files`` is checked by its upload's own acknowledgement (the listing, sent beside it,
        cannot see it yet); every earlier file, this writer's or another's (``add_entries``),
        by the listing. ``inline`` names files of ``files`` (bytes only) whose compressed copy
        the marker carries too, while the copies total at most ``MAX_INLINE_BYTES``: a reader
        of the marker then has them without another request (``Manifest.inline_bytes``).

        Idempotent against lost replies: a marker request applied whose answer never came
        back is settled by reading the marker back, and this save's own marker (the very
        bytes this commit sent) means the commit succeeded.

        Raises ``CommitConflictError`` if the step is already committed (by anyone else),
        ``WriteAbortedError`` if a file written before this call is missing from storage (it
        wins over the other refusals), ``FencedOutError`` if a newer attempt registered, and a
        failed write's own error; nothing is committed then (``abort`` removes the payload).
        ``BackendUnavailableError`` after the marker was sent means its outcome is unknown:
        the payload is kept (``abort`` removes nothing) and the marker decides; calling
        ``commit`` again settles it, sending (or finding) the very same marker (``metadata``
        and ``files`` are then those of the first call).
        """
        if self._state == "unknown" and self._sent is not None:
            manifest = self._sent  # settle the earlier call: the very same marker, found or sent
        else:
            manifest = self._prepare(metadata, dict(files or {}), set(inline))
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
        self._drop_lease()  # the marker names what the lease protected
        return manifest

    def _drop_lease(self) -> None:
        """Remove this save's lease (one request; a lease left behind by a kill only protects
        its base's chunks until the gc grace has passed)."""
        lease, path = self._lease, self._lease_path
        if lease is None or path is None:
            return
        self._lease = None
        with contextlib.suppress(Exception):
            lease.result()
            remove_files(self._location, [path])

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
        if self._chunks is not None:  # chunks only this save uploaded: no marker names them
            remove_files(location, self._chunks.uploaded)
        self._drop_lease()
        if self.primary:
            remove_files(location, [f.path for f in list_files(location, self.payload_path)])
            remove_empty_dirs(location, self.payload_path)
            remove_dir(location, self.path)  # only if nothing else is in it
        else:
            with self._lock:
                own = [f"{self.payload_path}/{n}" for n in self._own]
            remove_files(location, own)
        self._state = "aborted"

    def _prepare(
        self, metadata: Mapping[str, Any] | None, files: dict[str, Payload], inline: set[str]
    ) -> Manifest:
        """The last files and the checks before a marker (payload listing and fence re-check),
        all sent together, and the manifest the marker will hold."""
        self._check_open()
        if not self.primary:
            raise WriteAbortedError(
                f"only the primary writer (RunStore.begin) may commit {self.url}; hand "
                "this writer's entries to it with add_entries()",
                run=self.run,
                step=self.step,
            )
        strays = sorted(inline - set(files))
        if strays:
            raise InvalidArgumentError(
                f"inline names {', '.join(map(repr, strays[:5]))}, not among the files passed "
                f"to commit {self.url}: name only files of commit(files=...)"
            )
        location = self._location
        earlier = self.entries
        # The listing, the fence re-check and the last uploads are independent: they go out
        # together and the marker goes out only once all passed (a missing file is reported
        # first, then a newer attempt). The listing checks the files written before this
        # call; the last files are acknowledged by the store as their uploads complete. The
        # re-check narrows the window in which a stale attempt can still publish a marker;
        # readers ignore one that slips through (its epoch is not in the lineage).
        steps: list[Callable[[], object]] = []
        # a deduplicated file has no payload file: its chunks were acknowledged as uploaded,
        # or are the base's, which retention keeps (docs/dedup.md)
        plain = [entry for entry in earlier if entry.chunks is None]
        if plain:
            steps.append(functools.partial(self._check_payload_present, plain))
        if self.fence is not None:
            steps.append(functools.partial(check_fence, self._location, self._layout, self.fence))
        if files:
            steps.append(functools.partial(self.write_many, files))
        if self._base is not None:
            steps.append(self._check_base)
        concurrently(*steps)
        sync_dirs(location, sorted(self._dirs, key=len, reverse=True))  # local disk: fsync
        entries = self.entries
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
            inline=_copies(files, inline),
            chunk_scope=self.chunk_scope,
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

    def _check_base(self) -> None:
        base = self._base
        assert base is not None
        if self._lease is not None:
            self._lease.result()  # the lease is out before the base is looked at
        layout = self._location.run_layout(base.run)
        data = marker_bytes(self._location, layout, base.step)
        if data is None or parse_marker(self._location, layout, base.step, data).save_id != (
            base.save_id
        ):
            self._state = "failed"
            raise WriteAbortedError(
                f"refusing to commit {self.url}: it lists chunks of step {base.step}, whose "
                "checkpoint was deleted while it saved (retention never deletes a run's newest "
                "checkpoint: was it deleted by hand?); save again",
                run=self.run,
                step=self.step,
            )

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


def _copies(files: Mapping[str, Payload], names: set[str]) -> dict[str, str]:
    """Compressed copies of the files ``names`` of ``files`` (bytes only), in name order while
    they total at most ``MAX_INLINE_BYTES``; a file that would pass the limit is left out."""
    copies, total = {}, 0
    for name in sorted(names):
        data = files.get(name)
        if not isinstance(data, bytes | bytearray | memoryview):
            continue
        if memoryview(data).nbytes > MAX_INLINE_FILE:
            continue
        copy = inline_copy(data)
        size = len(copy) * 3 // 4  # the compressed bytes
        if total + size > MAX_INLINE_BYTES:
            continue
        total += size
        copies[name] = copy
    return copies
