"""The manager's background (``async_save``) saves: the one pending save, its commit thread,
the stager whose host buffers the saves reuse, and how a failure reaches the job.

An async save returns once its tensors are staged; torch DCP writes them in the background,
and when that finishes a thread of ours commits the checkpoint. At most one save is pending:
the next save (and ``wait``, ``load_latest``, ``close``) waits for it first and raises its
failure, so a failure is never lost and saves never overlap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from zephon import dcp as zdcp
from zephon.errors import as_zephon_error

__all__ = ["Background"]


class Background:
    """The pending background save of one manager (at most one at a time)."""

    def __init__(self) -> None:
        self._pending: Future | None = None
        self._stager: zdcp.ZephonStager | None = None
        self._lock = threading.Lock()

    def stager(self) -> zdcp.ZephonStager:
        """One stager for the job's async saves: its host buffers are reused by the next save
        (which waits for the previous one first), instead of allocated anew each time."""
        if self._stager is None:
            self._stager = zdcp.ZephonStager()
        return self._stager

    def start(
        self,
        step: int,
        written: Future,
        returned: threading.Event,
        *,
        commit: Callable[[], None],
        fail: Callable[[BaseException], None],
    ) -> None:
        """Once DCP's ``written`` future is done and the save call ``returned``, ``commit()``
        on a thread of its own; if either raises, ``fail(exc)`` and keep the failure (as a
        Zephon error) for the next ``wait``."""
        done: Future = Future()

        def finish(upload: Future) -> None:
            try:
                upload.result()
                returned.wait()
                commit()
            except BaseException as exc:  # noqa: BLE001 - surfaced by the next call
                fail(exc)
                done.set_exception(as_zephon_error(exc))
                return
            done.set_result(step)

        written.add_done_callback(
            lambda f: threading.Thread(
                target=finish, args=(f,), name=f"zephon-commit-{step}", daemon=True
            ).start()
        )
        with self._lock:
            self._pending = done

    def wait(self) -> None:
        """Wait for the pending save, if any; raise its failure."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Release the stager's host buffers (after ``wait``)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
