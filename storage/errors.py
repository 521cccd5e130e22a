"""The storage layer's exceptions: one root, a subclass per thing a caller can act on.

Every message names the object (URL with credentials masked, run, step, file) and the fix.
Backend exceptions are translated once, where the storage layer calls fsspec.
"""

from __future__ import annotations

from collections.abc import Sequence


class StorageError(Exception):
    """Root of every error the storage layer raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        run: str | None = None,
        step: int | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.run = run
        self.step = step
        self.path = path


class InvalidNameError(StorageError, ValueError):
    """A run name, step or URL that the layout refuses."""


class BackendUnavailableError(StorageError):
    """The storage backend cannot be used: its package is missing, or it does not answer."""


class CheckpointNotFoundError(StorageError, FileNotFoundError):
    """The checkpoint (or a file inside it) does not exist, or is not committed."""


class CommitConflictError(StorageError):
    """The step is already committed; a commit never overwrites another one."""


class CorruptCheckpointError(StorageError):
    """The marker does not parse, or files fail verification; ``problems`` names each one."""

    def __init__(self, message: str, *, problems: Sequence[str] = (), **where) -> None:
        super().__init__(message, **where)
        self.problems = list(problems)


class WriteAbortedError(StorageError):
    """A writer was used after it was committed or aborted, or a write into it failed."""


class StaleAttemptError(StorageError):
    """A newer attempt (job start) of the run took over: this process must stop saving.

    ``epoch`` is the caller's fencing token; ``current`` describes the attempt that holds the
    run now (an ``AttemptRecord``), when it could be read.
    """

    def __init__(self, message: str, *, epoch: int, current: object | None = None, **where):
        super().__init__(message, **where)
        self.epoch = epoch
        self.current = current
