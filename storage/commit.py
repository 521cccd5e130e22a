"""How the commit marker is created exclusively on each kind of backend.

Policy is kept apart from mechanism: ``marker_protocol_for`` is the one place that decides which
protocol a location gets; each protocol is a small class with one method. Every protocol either
creates the marker with the given bytes or raises ``FileExistsError``, and a reader never sees
a partially written marker.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Protocol

from fsspec.spec import AbstractFileSystem

from storage.location import Location

__all__ = [
    "MarkerProtocol",
    "PosixLinkProtocol",
    "ConditionalPutProtocol",
    "CheckThenPutProtocol",
    "marker_protocol_for",
    "fsync_dir",
]


class MarkerProtocol(Protocol):
    #: True when the backend itself refuses a second create, so a race has exactly one winner.
    exclusive: bool

    def create(self, fs: AbstractFileSystem, path: str, data: bytes) -> None:
        """Create ``path`` holding ``data``; raise FileExistsError if it already exists."""
        ...


def fsync_dir(path: str) -> None:
    """Make a directory's entries durable (POSIX); a no-op where directories can't be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (e.g. certain FUSE mounts) refuse fsync on directories
    finally:
        os.close(fd)


class PosixLinkProtocol:
    """Write a temp file, fsync it, then ``link`` it to the marker name.

    ``link`` fails with EEXIST if the marker exists, so it is exclusive and atomic; the marker
    appears with its full content at once. Where hard links are not supported (some network
    file systems), an ``O_EXCL`` claim file serialises committers and ``rename`` publishes.
    """

    exclusive = True

    def create(self, fs: AbstractFileSystem, path: str, data: bytes) -> None:
        directory = os.path.dirname(path)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:
                self._claim_then_rename(tmp, path)
                tmp = ""
        finally:
            if tmp:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        fsync_dir(directory)

    @staticmethod
    def _claim_then_rename(tmp: str, path: str) -> None:
        claim = f"{path}.claim"
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # FileExistsError
        os.close(fd)
        if os.path.exists(path):
            raise FileExistsError(path)
        os.rename(tmp, path)


class ConditionalPutProtocol:
    """One create-only PUT: S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``.

    s3fs and gcsfs send the precondition for ``pipe_file(..., mode="create")`` and turn the 412
    into FileExistsError. fsspec's memory filesystem honours the same mode in-process.
    """

    exclusive = True

    def create(self, fs: AbstractFileSystem, path: str, data: bytes) -> None:
        fs.pipe_file(path, data, mode="create")


class CheckThenPutProtocol:
    """Best effort for backends without a create-only write: check, then write.

    Two committers racing inside the gap between the check and the write can both succeed
    (the last write wins). Use S3, GCS or a POSIX file system where that matters.
    """

    exclusive = False

    def create(self, fs: AbstractFileSystem, path: str, data: bytes) -> None:
        if fs.exists(path):
            raise FileExistsError(path)
        fs.pipe_file(path, data)


_CONDITIONAL = {"s3", "s3a", "gs", "gcs", "memory"}


def marker_protocol_for(location: Location) -> MarkerProtocol:
    """The marker protocol a location gets: the one place this policy lives."""
    if location.is_local:
        return PosixLinkProtocol()
    if location.protocol in _CONDITIONAL:
        return ConditionalPutProtocol()
    return CheckThenPutProtocol()
