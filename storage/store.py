"""``CheckpointStore``: the public face of the storage layer.

Validates, then delegates to the small modules beside it (layout, writer, scan, verify,
backend). Paths are plain ``str`` in the filesystem's own form; URLs shown to people have their
credentials masked.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

from storage.backend import (
    backend_errors,
    file_exists,
    list_files,
    read_small,
    remove_empty_dirs,
    remove_files,
)
from storage.commit import fsync_dir
from storage.errors import CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError
from storage.layout import MARKER_NAME, step_dirname, validate_run, validate_step
from storage.location import Location, open_location
from storage.manifest import Manifest
from storage.scan import StepListing, scan_steps
from storage.verify import VerifyReport, verify_checkpoint
from storage.writer import CheckpointWriter

__all__ = ["CheckpointStore", "CheckpointReader", "Orphan"]

_ALL = object()


@dataclass(frozen=True, slots=True)
class Orphan:
    """An uncommitted step directory old enough for gc to remove."""

    run: str | None
    step: int
    path: str
    url: str
    newest_mtime: float | None
    age_s: float


class CheckpointReader:
    """Read access to one committed checkpoint, by the names its manifest lists."""

    def __init__(self, store: CheckpointStore, manifest: Manifest) -> None:
        self._store = store
        self.manifest = manifest
        self.path = store.checkpoint_path(manifest.run, manifest.step)
        self.url = store.location.display(self.path)

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.manifest.files]

    def _target(self, name: str) -> str:
        if self.manifest.file(name) is None:
            raise CheckpointNotFoundError(
                f"{name!r} is not a file of checkpoint {self.url} (it has {len(self.names)} "
                f"files, e.g. {', '.join(self.names[:3]) or 'none'})",
                url=self.url,
                run=self.manifest.run,
                step=self.manifest.step,
                path=name,
            )
        return f"{self.path}/{name}"

    def open(self, name: str) -> BinaryIO:
        target = self._target(name)
        location = self._store.location
        with backend_errors(location, f"opening {name} of {self.url}"):
            try:
                return location.fs.open(target, "rb")
            except FileNotFoundError:
                raise self._missing(name) from None

    def read_bytes(self, name: str) -> bytes:
        target = self._target(name)
        location = self._store.location
        with backend_errors(location, f"reading {name} of {self.url}"):
            try:
                return location.fs.cat_file(target)
            except FileNotFoundError:
                raise self._missing(name) from None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of one file, in one ranged request; fewer bytes than asked
        for means the file is shorter than that (the caller decides if that is damage)."""
        target = self._target(name)
        location = self._store.location
        with backend_errors(location, f"reading {name} of {self.url}"):
            try:
                return location.fs.cat_file(target, start=start, end=end)
            except FileNotFoundError:
                raise self._missing(name) from None

    def local_path(self, name: str) -> str | None:
        """The file's path on a local (POSIX) file system, for callers that read it in place
        (e.g. straight into tensor memory); None on object stores."""
        target = self._target(name)
        return target if self._store.location.is_local else None

    def missing(self, name: str) -> CorruptCheckpointError:
        """The error for a listed file that is not on storage."""
        return self._missing(name)

    def get_file(self, name: str, local_path: str | os.PathLike) -> None:
        target = self._target(name)
        location = self._store.location
        with backend_errors(location, f"downloading {name} of {self.url}"):
            try:
                location.fs.get_file(target, os.fspath(local_path))
            except FileNotFoundError:
                raise self._missing(name) from None

    def _missing(self, name: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{name} of committed checkpoint {self.url} is missing from storage; the checkpoint "
            "is damaged: run `zephon verify` and resume from an earlier checkpoint",
            url=self.url,
            run=self.manifest.run,
            step=self.manifest.step,
            path=name,
            problems=[f"{name}: missing"],
        )


class CheckpointStore:
    """Checkpoints under one root URL: ``<root>/<run>/save-<step>/`` (``run=None``: the
    inference layout ``<root>/save-<step>/``).

    Safe to share between threads. Several processes may use the same root at once; the commit
    marker's exclusive create decides between writers of the same step.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        max_workers: int = 8,
        part_size: int = 64 << 20,
    ) -> None:
        if part_size < 5 << 20:
            raise ValueError(
                f"part_size={part_size} is below S3's 5 MiB minimum multipart part; use >= 5242880"
            )
        self.location: Location = open_location(url, dict(storage_options or {}))
        #: threads writing or reading files of one checkpoint in parallel
        self.max_workers = max_workers
        #: bytes per multipart part; files of at least two parts upload in parts
        self.part_size = part_size
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def url(self) -> str:
        """The root URL, credentials masked."""
        return self.location.url

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    # -- layout --------------------------------------------------------------------------------

    def run_path(self, run: str | None) -> str:
        validate_run(run)
        return self.location.join(run) if run is not None else self.location.root

    def checkpoint_path(self, run: str | None, step: int) -> str:
        return f"{self.run_path(run)}/{step_dirname(step)}"

    def checkpoint_url(self, run: str | None, step: int) -> str:
        """The checkpoint directory's full URL (credentials masked), as printed to users."""
        return self.location.display(self.checkpoint_path(run, step))

    def _marker(self, run: str | None, step: int) -> str:
        return f"{self.checkpoint_path(run, step)}/{MARKER_NAME}"

    # -- writing -------------------------------------------------------------------------------

    def begin(
        self,
        run: str | None,
        step: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        save_id: str | None = None,
    ) -> CheckpointWriter:
        """Start writing checkpoint ``(run, step)``; returns the primary writer.

        Refuses a committed step (``CommitConflictError``); removes an uncommitted leftover of
        an earlier attempt first. Call on one process only; other processes ``attach``.
        """
        validate_run(run)
        validate_step(step)
        if self.is_committed(run, step):
            raise CommitConflictError(
                f"{self.checkpoint_url(run, step)} is already committed"
                f"{self._describe_commit(run, step)}; a committed step is never overwritten: "
                "save under a new step, or delete that checkpoint first",
                url=self.checkpoint_url(run, step),
                run=run,
                step=step,
            )
        path = self.checkpoint_path(run, step)
        location = self.location
        with backend_errors(location, f"preparing {self.checkpoint_url(run, step)}"):
            leftover = list_files(location, path)
            if leftover:
                remove_files(location, [f.path for f in leftover])
                remove_empty_dirs(location, path)
            if location.is_local:
                self._make_local_dirs(path)
        return CheckpointWriter(
            self, run, step, save_id or uuid.uuid4().hex, primary=True, metadata=metadata
        )

    def attach(self, run: str | None, step: int, *, save_id: str) -> CheckpointWriter:
        """A secondary writer into a checkpoint another process began (e.g. another rank):
        it writes files and reports entries, but never removes leftovers or commits."""
        validate_run(run)
        validate_step(step)
        return CheckpointWriter(self, run, step, save_id, primary=False)

    def _make_local_dirs(self, path: str) -> None:
        # Make the new directory entries durable up to the first one that already existed, so a
        # power loss cannot drop the step directory out from under a committed marker.
        missing = []
        probe = path
        while not os.path.isdir(probe):
            missing.append(probe)
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        os.makedirs(path, exist_ok=True)
        for directory in missing[1:] + [probe]:
            fsync_dir(directory)

    # -- reading -------------------------------------------------------------------------------

    def is_committed(self, run: str | None, step: int) -> bool:
        """Whether the step's marker exists: one request (or stat)."""
        marker = self._marker(run, step)
        location = self.location
        with backend_errors(location, f"checking {self.checkpoint_url(run, step)}"):
            return file_exists(location, marker)

    def list_steps(self, run: str | None) -> list[StepListing]:
        """Every step directory of a run, committed or not, from one listing."""
        return scan_steps(self.location, self.run_path(run))

    def committed_steps(self, run: str | None) -> list[int]:
        """The steps of ``run`` whose marker exists, ascending, from one listing."""
        return [s.step for s in self.list_steps(run) if s.committed]

    def latest_step(self, run: str | None) -> int | None:
        """The newest step whose marker exists and parses; None if the run has none.

        A marker that does not parse is skipped (it is not a complete checkpoint) and the next
        older one is tried.
        """
        for step in reversed(self.committed_steps(run)):
            try:
                self.read_manifest(run, step)
            except CorruptCheckpointError:
                continue
            except CheckpointNotFoundError:
                continue  # deleted since the listing
            return step
        return None

    def read_manifest(self, run: str | None, step: int) -> Manifest:
        """The manifest of a committed checkpoint; ``CheckpointNotFoundError`` if there is no
        marker, ``CorruptCheckpointError`` if it does not parse or names another checkpoint."""
        marker = self._marker(run, step)
        url = self.checkpoint_url(run, step)
        location = self.location
        with backend_errors(location, f"reading the marker of {url}"):
            try:
                data = read_small(location, marker)
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"{url} is not a committed checkpoint (no {MARKER_NAME} marker); list the "
                    f"run's checkpoints with `zephon checkpoints {run or '<run>'}`",
                    url=url,
                    run=run,
                    step=step,
                ) from None
        manifest = Manifest.from_json(data, where=location.display(marker))
        if manifest.run != run or manifest.step != step:
            raise CorruptCheckpointError(
                f"marker of {url} describes run {manifest.run!r} step {manifest.step}; it was "
                "copied or moved: checkpoints must stay where they were written",
                url=url,
                run=run,
                step=step,
                problems=[f"{MARKER_NAME}: names run {manifest.run!r} step {manifest.step}"],
            )
        return manifest

    def reader(self, run: str | None, step: int) -> CheckpointReader:
        return CheckpointReader(self, self.read_manifest(run, step))

    def verify(self, run: str | None, step: int, *, deep: bool = False) -> VerifyReport:
        """Check every listed file: exists with its size (shallow), and its CRC32C (deep)."""
        manifest = self.read_manifest(run, step)
        return verify_checkpoint(
            self.location,
            self.checkpoint_path(run, step),
            manifest,
            url=self.checkpoint_url(run, step),
            deep=deep,
            executor_factory=self._executor,
        )

    # -- deleting and gc -----------------------------------------------------------------------

    def delete(self, run: str | None, step: int) -> int:
        """Delete a checkpoint: marker first (it stops being complete), then the payload in
        batched requests, then the directory. Idempotent; finishes a delete that crashed.
        Returns the number of payload files removed."""
        return self.delete_many(run, [step])[step]

    def delete_many(self, run: str | None, steps: Iterable[int]) -> dict[int, int]:
        """Delete several checkpoints of one run with as few requests as the backend allows.

        Every marker goes first, in one batched request (none of them is complete any more
        before any payload is touched), then the payload of all of them in batches (S3:
        1,000 keys per DeleteObjects), found with one listing of the run when there are
        several steps. Idempotent. Returns step -> payload files removed.
        """
        steps = sorted({validate_step(s) for s in steps})
        if not steps:
            return {}
        location = self.location
        where = (
            self.checkpoint_url(run, steps[0])
            if len(steps) == 1
            else f"{len(steps)} checkpoints of {self.location.display(self.run_path(run))}"
        )
        with backend_errors(location, f"deleting {where}"):
            remove_files(location, [self._marker(run, step) for step in steps])
            if location.is_local:
                for step in steps:  # the markers' removal is durable before any payload goes
                    fsync_dir(self.checkpoint_path(run, step))
            payload = self._payload_of(run, steps)
            remove_files(location, [path for paths in payload.values() for path in paths])
            for step in steps:
                remove_empty_dirs(location, self.checkpoint_path(run, step))
        return {step: len(payload[step]) for step in steps}

    def _payload_of(self, run: str | None, steps: list[int]) -> dict[int, list[str]]:
        location = self.location
        if len(steps) == 1:
            path = self.checkpoint_path(run, steps[0])
            return {steps[0]: [f.path for f in list_files(location, path)]}
        wanted = {f"{self.checkpoint_path(run, step)}/": step for step in steps}
        found: dict[int, list[str]] = {step: [] for step in steps}
        base = self.run_path(run)
        listing = (
            list_files(location, base)
            if run is not None or location.is_local
            else [
                f for step in steps for f in list_files(location, self.checkpoint_path(run, step))
            ]
        )
        for listed in listing:
            head = listed.path[len(base) + 1 :].split("/", 1)[0]
            step = wanted.get(f"{base}/{head}/")
            if step is not None:
                found[step].append(listed.path)
        return found

    def runs(self) -> list[str]:
        """Names of the run directories under the root (one delimited listing)."""
        location = self.location
        with backend_errors(location, f"listing {location.url}"):
            try:
                entries = location.fs.ls(location.root, detail=True, refresh=True)
            except FileNotFoundError:
                return []
        names = []
        for info in entries:
            if info.get("type") != "directory":
                continue
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            with contextlib.suppress(Exception):
                names.append(validate_run(name))
        return sorted(n for n in names if n is not None)

    def has_inference_layout(self) -> bool:
        """Whether ``save-<step>`` directories sit directly under the root."""
        return bool(self.list_steps(None))

    def orphans(
        self,
        older_than_s: float,
        *,
        runs: Iterable[str | None] | None = None,
        now: float | None = None,
    ) -> list[Orphan]:
        """Uncommitted step directories whose newest object is older than ``older_than_s``.

        ``runs`` limits the search (``None`` in it means the inference layout); by default every
        run under the root and the inference layout are searched.
        """
        now = time.time() if now is None else now
        targets: list[str | None] = list(runs) if runs is not None else [*self.runs(), None]
        found = []
        for run in targets:
            for listing in scan_steps(self.location, self.run_path(run), with_ages=True):
                if listing.committed:
                    continue
                newest = listing.newest_mtime
                age = now - newest if newest is not None else float("inf")
                if age >= older_than_s:
                    found.append(
                        Orphan(
                            run,
                            listing.step,
                            listing.path,
                            self.location.display(listing.path),
                            newest,
                            age,
                        )
                    )
        return found

    # -- internals -----------------------------------------------------------------------------

    def _describe_commit(self, run: str | None, step: int) -> str:
        """ " by host/pid at time" for messages about an existing commit, if readable."""
        try:
            manifest = self.read_manifest(run, step)
        except Exception:
            return ""
        writer = manifest.writer
        return (
            f" (by {writer.get('host', '?')} pid {writer.get('pid', '?')} at "
            f"{manifest.committed_at}, save {manifest.save_id[:8]})"
        )

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.max_workers, thread_name_prefix="zephon-storage"
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
