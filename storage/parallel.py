"""Independent requests sent at once: one wait instead of several on a far-away store.

``begin`` checks the fence and probes the step's marker, ``commit`` lists the payload and
re-checks the fence: each pair is independent, and on S3 or GCS each request costs a round
trip (20-100 ms), so they go out together and the caller acts only once both answered.

The calls run on threads of their own, not on a store's executor: ``write_many`` may be
holding every executor thread, and a thread pool created before a ``fork`` has no threads in
the child. Two or three short-lived threads per save cost far less than one round trip.

``ahead`` sends requests whose answer is needed later: the caller does other work (a load,
a collective) meanwhile and waits on the future only when it needs the answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["ahead", "concurrently"]


def concurrently(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` at the same time and return their results in order.

    The first runs in the calling thread, every other one in a thread of its own. All of them
    finish before this returns (a caller never acts while a request is still under way); if
    any raised, the exception of the first one in argument order is raised, so callers put
    the check whose refusal matters most first.
    """
    if len(calls) <= 1:
        return [call() for call in calls]
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[index] = exc

    threads = [
        threading.Thread(target=run, args=(i,), name="zephon-storage-probe", daemon=True)
        for i in range(1, len(calls))
    ]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results


def ahead(call: Callable[[], Any], name: str = "zephon-ahead") -> Future:
    """Start ``call`` in a thread of its own now; its result (or exception) in the future.

    The caller must wait on the future (``result()``) before it acts on what ``call`` does,
    also when it gives up for another reason, so no request outlives the decision it serves.
    """
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done
