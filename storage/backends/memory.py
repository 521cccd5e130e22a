"""fsspec's in-process memory filesystem: for tests and demos in one process."""

from __future__ import annotations

import contextlib

from storage.backends.base import Backend

__all__ = ["MemoryBackend"]


class MemoryBackend(Backend):
    """``memory://``: fsspec honours ``mode="create"`` in-process, so markers are exclusive
    among the threads of one process; directories are entries, removed with ``rm``; nothing
    is seen by other processes."""

    protocols = ("memory",)
    exclusive_create = True
    has_directories = True
    cross_process = False

    def display(self, path: str) -> str:
        return f"memory://{path}"

    def remove_empty_dirs(self, top: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.rm(top, recursive=True)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data, mode="create")
