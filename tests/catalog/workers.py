"""Functions run in child processes by the catalog tests (spawned, so they must be importable).

Each builds its own ``Catalog``: engines and connections never cross a process boundary.
"""

from __future__ import annotations

from typing import Any

from zephon.catalog import Catalog


def open_catalog(url: str, start: Any) -> str | None:
    start.wait(60)
    with Catalog(url) as opened:
        return opened.current_revision()


def _child(target: Any, args: tuple, start: Any, results: Any, index: int) -> None:
    import traceback

    try:
        results.put((index, True, target(*args, start)))
    except BaseException:  # report everything: the parent asserts nothing failed
        results.put((index, False, traceback.format_exc()))


def run_in_processes(jobs: list[tuple[Any, tuple]], timeout: float = 120) -> list[Any]:
    """Run each ``(target, args)`` as ``target(*args, start)`` in a spawned process; results
    in order.

    ``start`` is a barrier shared by the children: each calls ``start.wait(60)`` once ready
    (catalog opened), so the contended part begins at the same moment in all of them.
    Raises AssertionError with the child's traceback if any child raised or hung.
    """
    import multiprocessing
    import queue

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start = context.Barrier(len(jobs))
    processes = [
        context.Process(target=_child, args=(target, args, start, results, i))
        for i, (target, args) in enumerate(jobs)
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


def begin_then_commit(url: str, run: str, step: int, start: Any) -> str:
    """Race to save the same step: 'committed', 'conflict' (re-armed by another) or 'exists'."""
    from zephon.catalog import CheckpointExistsError, StateConflictError

    with Catalog(url) as catalog:
        start.wait(60)
        try:
            begun = catalog.begin_checkpoint(run, step, f"/c/{run}/save-{step}")
        except CheckpointExistsError:
            return "exists"
        try:
            catalog.mark_committed(
                run,
                step,
                begun.save_id,
                bytes=1,
                file_count=1,
                manifest_checksum=begun.save_id,
            )
        except StateConflictError:
            return "conflict"
        return "committed"


def claim_steps(url: str, run: str, steps: list[int], start: Any) -> list[int]:
    with Catalog(url) as catalog:
        start.wait(60)
        return [c.step for c in catalog.claim_for_deletion(run, steps)]


def ensure_run(url: str, run: str, start: Any) -> str:
    with Catalog(url) as catalog:
        start.wait(60)
        return catalog.ensure_run(run, f"/c/{run}", num_to_keep=2).name


def stress_committer(
    url: str, run: str, first_step: int, seconds: float, least: int, done: str, start: Any
):
    """Commit increasing steps for ``seconds`` and at least ``least`` commits (however slow
    the machine), then create the file ``done``; every 5th step is begun and left pending.

    Returns ``(commits, pending)``: ``commits`` as ``(step, call started, call ended)``,
    ``pending`` as ``(step, save_id)``.
    """
    import pathlib
    import random
    import time

    commits, pending = [], []
    with Catalog(url) as catalog:
        start.wait(60)
        deadline = time.time() + seconds
        step = first_step
        while time.time() < deadline or len(commits) < least:
            begun = catalog.begin_checkpoint(run, step, f"/c/{run}/save-{step}")
            if step % 5 == 0:
                pending.append((step, begun.save_id))
            else:
                started = time.time()
                catalog.mark_committed(
                    run, step, begun.save_id, bytes=step, file_count=1, manifest_checksum=None
                )
                commits.append((step, started, time.time()))
            step += 1
            time.sleep(random.uniform(0, 0.01))
    pathlib.Path(done).touch()
    return commits, pending


def stress_gc(url: str, run: str, done: str, greedy: bool, start: Any):
    """Plan, claim and delete, like `zephon gc` in a loop, until the committer created the
    file ``done``, then once more.

    A ``greedy`` gc asks to claim every committed step, so only the claim's own re-check
    stands between it and the rows retention must keep.

    Returns ``[(step, token, claim call started, claim call ended, mark_deleted result)]``.
    """
    import os
    import random
    import time

    deleted = []
    with Catalog(url) as catalog:
        start.wait(60)
        last = False
        while not last:
            last = os.path.exists(done)
            if greedy:
                wanted = [c.step for c in catalog.list_checkpoints(run, states="committed")]
            else:
                wanted = catalog.retention_plan(run).to_delete
            started = time.time()
            won = catalog.claim_for_deletion(run, wanted)
            ended = time.time()
            for claimed in won:
                time.sleep(random.uniform(0, 0.003))  # the storage delete
                marked = catalog.mark_deleted(run, claimed.step, claimed.claimed_by)
                deleted.append((claimed.step, claimed.claimed_by, started, ended, marked))
            time.sleep(random.uniform(0, 0.01))
    return deleted


def upload_commits(url: str, run: str, rounds: int, start: Any) -> list[str]:
    """Per round (step): start the save_dir replica of save ``old-<step>``, then, at the
    barrier, commit it: 'committed', or 'lost' when a new save re-armed the row first."""
    from zephon.catalog import StateConflictError

    outcomes = []
    with Catalog(url) as catalog:
        for step in range(rounds):
            catalog.replica_started(
                run, step, tier="save_dir", host="", location=f"/c/{run}/save-{step}",
                save_id=f"old-{step}",
            )  # fmt: skip
            start.wait(60)
            try:
                catalog.replica_committed(
                    run, step, tier="save_dir", host="", save_id=f"old-{step}", bytes=10
                )
                outcomes.append("committed")
            except StateConflictError:
                outcomes.append("lost")
    return outcomes


def new_save_starts(url: str, run: str, rounds: int, start: Any) -> list[str]:
    """Per round: at the barrier, start the save_dir replica of a new save ``new-<step>``
    (re-arming the old save's row, pending or committed); returns the states it left."""
    states = []
    with Catalog(url) as catalog:
        for step in range(rounds):
            start.wait(60)
            record = catalog.replica_started(
                run, step, tier="save_dir", host="", location=f"/c/{run}/save-{step}",
                save_id=f"new-{step}",
            )  # fmt: skip
            states.append(record.state)
    return states
