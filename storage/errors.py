"""The storage layer's exceptions: one root, a subclass per thing a caller can act on.

Every message names the object (URL with credentials masked, run, step, file) and the fix.
Backend exceptions are translated once, where the storage layer calls fsspec. Messages, URLs
and problems are redacted on construction as well, so a message that quotes a path or a
backend's text never carries a credential, whoever built it.
"""

from __future__ import annotations

from collections.abc import Sequence

from zephon.storage.redact import mask_url, redact


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
        super().__init__(redact(message))
        self.url = None if url is None else mask_url(url)
        self.run = run
        self.step = step
        self.path = path  # a file name inside a checkpoint, kept verbatim for callers


class InvalidNameError(StorageError, ValueError):
    """A run name, step or URL that the layout refuses."""


class InvalidArgumentError(StorageError, ValueError):
    """An argument out of range for the call it was passed to (a part size, a worker count, a
    CRC that is not one, a fence used before it decided where it resumes)."""


class BackendUnavailableError(StorageError):
    """The storage backend cannot be used: its package is missing, or it does not answer."""


class StorageOptionsRefusedError(BackendUnavailableError):
    """The backend library refused the options it was given (an unknown keyword, a value of
    the wrong type); ``what`` says what was being done, without the advice, so that a caller
    that knows where the options came from (a flag, a variable) can name it in its own fix."""

    ADVICE = "the backend refused it or its storage options: check the URL and fix"

    def __init__(self, what: str, *, url: str | None = None) -> None:
        super().__init__(f"{what}; {self.ADVICE} the storage options", url=url)
        self.what = redact(what)


class CheckpointNotFoundError(StorageError, FileNotFoundError):
    """The checkpoint (or a file inside it) does not exist, or is not committed."""


class CommitConflictError(StorageError):
    """The step is already committed; a commit never overwrites another one."""


class CorruptCheckpointError(StorageError):
    """The marker does not parse, or files fail verification; ``problems`` names each one."""

    def __init__(self, message: str, *, problems: Sequence[str] = (), **where) -> None:
        super().__init__(message, **where)
        self.problems = [redact(problem) for problem in problems]


class WriteAbortedError(StorageError):
    """A writer was used after it was committed or aborted, or a write into it failed."""


class FencedOutError(StorageError):
    """A newer attempt (job start) of the run took over: this process must stop saving.

    ``epoch`` is the caller's fencing token; ``current`` describes the attempt that holds the
    run now (an ``AttemptRecord``), when it could be read.
    """

    def __init__(self, message: str, *, epoch: int, current: object | None = None, **where):
        super().__init__(message, **where)
        self.epoch = epoch
        self.current = current
