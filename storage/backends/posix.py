"""Local disk (and any POSIX mount): ``os`` calls, fsync, and a hard link for the marker."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator
from typing import IO, Any, ClassVar

from fsspec.spec import AbstractFileSystem

from zephon.storage.backends.base import Backend, TranslatedReader

__all__ = ["PosixBackend", "fsync_dir"]


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


class PosixBackend(Backend):
    """fsspec's local filesystem, used through ``os`` directly: files are fsynced before they
    count as written, directory entries are fsynced before a commit, empty directories are
    removed, and the marker is a temp file hard-linked to its name (exclusive and atomic)."""

    protocols = ("file", "local")
    exclusive_create = True
    posix_paths = True
    has_directories = True
    #: bound by the disk and the CPU, not by waiting for answers
    default_workers: ClassVar[int] = 8

    @classmethod
    def normalise_root(cls, fs: AbstractFileSystem, root: str) -> str:
        return fs._strip_protocol(root)

    def display(self, path: str) -> str:
        return path

    # -- directories ---------------------------------------------------------------------------

    def _make_dirs(self, path: str, *, durable: bool = False) -> None:
        if not durable:
            os.makedirs(path, exist_ok=True)
            return
        # Make the new directory entries durable up to the first one that already existed, so
        # a power loss cannot drop the step directory out from under a committed marker.
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

    def _sync_dirs(self, paths: Iterable[str]) -> None:
        for path in paths:
            fsync_dir(path)

    def _remove_dir(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(path)

    def _remove_empty_dirs(self, top: str) -> None:
        for dirpath, _dirs, _files in os.walk(top, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)

    # -- listing and reading -------------------------------------------------------------------

    def entries(self, path: str) -> list[os.DirEntry]:
        """The entries of directory ``path`` (one directory read); absent lists as empty."""
        with self._doing("listing", path):
            try:
                return list(os.scandir(path))
            except (FileNotFoundError, NotADirectoryError):
                return []

    def _file_exists(self, path: str) -> bool:
        return os.path.isfile(path)

    def _read_ranges(self, path: str, size: int, chunk: int) -> Iterator[bytes]:
        with open(path, "rb") as handle:
            while piece := handle.read(chunk):
                yield piece

    def _read_range_into(self, path: str, start: int, buffer: Any) -> int:
        # One preadv straight into the caller's memory (no bytes object), looping only where
        # the kernel returns less than asked before the end of the file.
        view = memoryview(buffer).cast("B")
        fd = os.open(path, os.O_RDONLY)
        try:
            got = 0
            while got < view.nbytes:
                count = os.preadv(fd, [view[got:]], start + got)
                if not count:
                    break
                got += count
            return got
        finally:
            os.close(fd)

    def open_in_place(self, path: str) -> IO[bytes]:
        """The file unbuffered, for reads straight into the caller's memory (``readinto``);
        its reads translate their errors. ``FileNotFoundError`` if it is missing."""
        with self._doing("opening", path):
            handle = open(path, "rb", buffering=0)  # noqa: SIM115 - the caller closes it
        return TranslatedReader(self, handle, path)  # type: ignore[return-value]

    def _open_read(self, path: str, size: int) -> IO[bytes]:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it

    # -- writing and deleting ------------------------------------------------------------------

    def _put_bytes(self, path: str, data: bytes, part_size: int) -> None:
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    def _put_small(self, path: str, data: bytes) -> None:
        with open(path, "wb") as handle:
            handle.write(data)

    def _open_write(self, path: str, part_size: int) -> IO[bytes]:
        return open(path, "wb")  # noqa: SIM115 - closed by finish_write or discard_write

    def _finish_write(self, handle: IO[bytes]) -> None:
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()

    def _discard_write(self, handle: IO[bytes]) -> None:
        # An OS file is visible as soon as it is opened: what was written goes with it.
        with contextlib.suppress(Exception):
            handle.close()
        with contextlib.suppress(OSError):
            os.unlink(handle.name)

    def _create_exclusive(self, path: str, data: bytes) -> None:
        """Write a temp file, fsync it, then ``link`` it to the marker name.

        ``link`` fails with EEXIST if the marker exists, so it is exclusive and atomic; the
        marker appears with its full content at once. Where hard links are not supported (some
        network file systems), an ``O_EXCL`` claim file serialises creators and ``rename``
        publishes.
        """
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

    def _remove_files(self, paths: list[str]) -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
