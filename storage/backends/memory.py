"""fsspec's in-process memory filesystem: for tests and demos in one process."""

from __future__ import annotations

from zephon.storage.backends.base import Backend

__all__ = ["MemoryBackend"]


class MemoryBackend(Backend):
    """``memory://``: fsspec honours ``mode="create"`` in-process, so markers are exclusive
    among the threads of one process. Directories are implicit (a path is a directory while
    a file is below it), so nothing is left to remove; nothing is seen by other processes."""

    protocols = ("memory",)
    exclusive_create = True
    cross_process = False

    def display(self, path: str) -> str:
        return f"memory://{path}"

    def _create_exclusive(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data, mode="create")
