"""Functions run in child processes by the catalog tests (spawned, so they must be importable).

Each builds its own ``Catalog``: engines and connections never cross a process boundary.
"""

from __future__ import annotations

from typing import Any

from catalog import Catalog


def wait_until(start_at: float) -> None:
    """Sleep until the wall-clock time ``start_at``, so spawned children start together."""
    import time

    time.sleep(max(0.0, start_at - time.time()))


def open_catalog(url: str, start_at: float) -> str | None:
    wait_until(start_at)
    with Catalog(url) as opened:
        return opened.current_revision()


def _child(target: Any, args: tuple, results: Any, index: int) -> None:
    import traceback

    try:
        results.put((index, True, target(*args)))
    except BaseException:  # report everything: the parent asserts nothing failed
        results.put((index, False, traceback.format_exc()))


def run_in_processes(target: Any, arg_lists: list[tuple], timeout: float = 120) -> list[Any]:
    """Run ``target(*args)`` in one spawned process per entry; return results in order.

    Raises AssertionError with the child's traceback if any child raised or hung.
    """
    import multiprocessing
    import queue

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_child, args=(target, args, results, i))
        for i, args in enumerate(arg_lists)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    failures = []
    try:
        for _ in processes:
            try:
                index, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                failures.append(f"a child process did not report within {timeout} s")
                break
            if ok:
                collected[index] = value
            else:
                failures.append(value)
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
    assert not failures, "\n".join(failures)
    return [collected[i] for i in range(len(processes))]
