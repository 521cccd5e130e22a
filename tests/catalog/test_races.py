"""Races between threads and processes on the same rows: exactly one side wins each time."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any

import pytest

from tests.catalog import workers
from tests.catalog.conftest import commit_step, in_threads, register
from zephon.catalog import Catalog, FencedOutError, StateConflictError, attempts, transitions


def test_commit_and_fail_racing_on_one_attempt_move_the_row_once(catalog_url):
    with Catalog(catalog_url) as catalog:
        catalog.ensure_run("r", "/c")
        begun = catalog.begin_checkpoint("r", 1, "/c/1")
    catalogs = [Catalog(catalog_url) for _ in range(6)]
    barrier = threading.Barrier(len(catalogs))
    outcomes: list[str] = [""] * len(catalogs)

    def contend(index: int) -> None:
        catalog = catalogs[index]
        barrier.wait()
        try:
            if index % 2:
                catalog.mark_committed(
                    "r", 1, begun.save_id, bytes=1, file_count=1, manifest_checksum=None
                )
                outcomes[index] = "committed"
            else:
                catalog.mark_failed("r", 1, begun.save_id, "racing")
                outcomes[index] = "failed"
        except StateConflictError:
            outcomes[index] = "lost"

    in_threads(contend, catalogs)

    with Catalog(catalog_url) as catalog:
        final = catalog.get_checkpoint("r", 1).state
        moves = [e.action for e in catalog.events(run="r") if e.action in ("committed", "failed")]
    assert moves == [final]  # exactly one transition happened
    # The winner's side reports success (idempotently for its allies); the other side lost.
    assert set(outcomes) == {final, "lost"}
    assert Counter(outcomes)[final] == 3


@pytest.mark.slow
def test_processes_saving_the_same_step_leave_exactly_one_commit(catalog_url):
    with Catalog(catalog_url) as catalog:
        catalog.ensure_run("r", "/c")
    results = workers.run_in_processes([(workers.begin_then_commit, (catalog_url, "r", 42))] * 4)
    assert results.count("committed") == 1, results
    assert set(results) <= {"committed", "conflict", "exists"}
    with Catalog(catalog_url) as catalog:
        row = catalog.get_checkpoint("r", 42)
        assert row.state == "committed" and row.manifest_checksum == row.save_id


@pytest.mark.slow
def test_processes_claiming_the_same_rows_split_them_without_overlap(catalog_url):
    with Catalog(catalog_url) as catalog:
        catalog.ensure_run("r", "/c", num_to_keep=1)
        for step in range(30):
            commit_step(catalog, "r", step)
    wanted = list(range(30))
    results = workers.run_in_processes([(workers.claim_steps, (catalog_url, "r", wanted))] * 3)
    claimed = [step for won in results for step in won]
    assert sorted(claimed) == list(range(29))  # each deletable row exactly once, never 29


@pytest.mark.slow
def test_processes_ensuring_the_same_new_run_create_it_once(catalog_url):
    results = workers.run_in_processes([(workers.ensure_run, (catalog_url, "new"))] * 4)
    assert results == ["new"] * 4
    with Catalog(catalog_url) as catalog:
        assert [e.action for e in catalog.events(run="new")] == ["run_created"]


# -- fencing: a registration against an old attempt's commit -----------------------------------


def _pause_after(monkeypatch, module: Any, name: str) -> tuple[threading.Event, threading.Event]:
    """Make ``module.name`` stop after doing its work, inside its transaction, until released.

    Returns ``(reached, release)``. The transaction keeps every lock it took meanwhile, which
    is how the tests put one side "in flight" while the other tries to proceed.
    """
    reached, release = threading.Event(), threading.Event()
    original = getattr(module, name)

    def paused(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        reached.set()
        assert release.wait(60), "the test never released the paused transaction"
        return result

    monkeypatch.setattr(module, name, paused)
    return reached, release


def _in_thread(results: dict[str, Any], key: str, call: Any) -> threading.Thread:
    def target() -> None:
        try:
            results[key] = call()
        except Exception as exc:  # the test inspects what each side got
            results[key] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _old_commit(catalog: Catalog, step: int, save_id: str, epoch: int):
    return lambda: catalog.mark_committed(
        "r", step, save_id, epoch=epoch, bytes=1, file_count=1, manifest_checksum=None
    )


@pytest.fixture
def old_save(catalog_url):
    """Run ``r`` at epoch 1 with step 30 pending, begun by attempt 1."""
    with Catalog(catalog_url) as catalog:
        catalog.ensure_run("r", "/c")
        register(catalog, "r", 1)
        return catalog.begin_checkpoint("r", 30, "/c/30", epoch=1)


def test_a_registration_waits_for_an_old_commit_in_flight_then_abandons_it(
    catalog_url, old_save, monkeypatch
):
    reached, release = _pause_after(monkeypatch, transitions, "commit")
    results: dict[str, Any] = {}
    with Catalog(catalog_url) as old, Catalog(catalog_url) as new:
        committing = _in_thread(results, "commit", _old_commit(old, 30, old_save.save_id, 1))
        assert reached.wait(30)
        registering = _in_thread(results, "register", lambda: register(new, "r", 2, 20))
        time.sleep(0.5)
        assert "register" not in results, "the registration did not wait for the commit"
        release.set()
        committing.join(60)
        registering.join(60)
        assert results["commit"].state == "committed"  # committed first...
        assert results["register"].abandoned == (30,)  # ...then abandoned by the registration
        assert new.get_checkpoint("r", 30).state == "stale"
        assert new.latest_committed("r") is None


def test_an_old_commit_waits_for_a_registration_in_flight_then_is_refused(
    catalog_url, old_save, monkeypatch
):
    reached, release = _pause_after(monkeypatch, attempts, "register")
    results: dict[str, Any] = {}
    with Catalog(catalog_url) as old, Catalog(catalog_url) as new:
        registering = _in_thread(results, "register", lambda: register(new, "r", 2, 20))
        assert reached.wait(30)
        committing = _in_thread(results, "commit", _old_commit(old, 30, old_save.save_id, 1))
        time.sleep(0.5)
        assert "commit" not in results, "the commit did not wait for the registration"
        release.set()
        registering.join(60)
        committing.join(60)
        assert results["register"].abandoned == (30,)
        assert isinstance(results["commit"], FencedOutError)
        assert results["commit"].current.epoch == 2
        assert new.get_checkpoint("r", 30).state == "stale"


def _abandoned_but_committed(catalog: Catalog, run: str) -> list[tuple[int, int]]:
    """Committed rows of an attempt that a newer attempt abandoned: must always be empty."""
    lineage = catalog.list_attempts(run)
    return [
        (row.step, row.epoch)
        for row in catalog.list_checkpoints(run, states="committed")
        for attempt in lineage
        if attempt.epoch > row.epoch
        and (attempt.resumed_from is None or attempt.resumed_from < row.step)
    ]


def _race_once(old: Catalog, new: Catalog, epoch: int) -> str:
    """Attempt ``epoch`` commits step ``10 * epoch`` while attempt ``epoch + 1`` registers,
    resuming from just below it; returns how the commit ended."""
    step = 10 * epoch
    begun = old.begin_checkpoint("r", step, f"/c/{step}", epoch=epoch)
    barrier = threading.Barrier(2)
    results: dict[str, Any] = {}

    def jittered(call: Any) -> Any:
        def run() -> Any:
            barrier.wait(30)
            time.sleep(random.uniform(0, 0.005))
            return call()

        return run

    commit = _old_commit(old, step, begun.save_id, epoch)
    threads = [
        _in_thread(results, "commit", jittered(commit)),
        _in_thread(results, "register", jittered(lambda: register(new, "r", epoch + 1, step - 1))),
    ]
    for thread in threads:
        thread.join(60)
    assert results["register"].abandoned == (step,), results
    assert new.get_checkpoint("r", step).state == "stale"
    if isinstance(results["commit"], FencedOutError):
        return "refused"
    assert results["commit"].state == "committed", results
    return "committed then staled"


@pytest.mark.slow
def test_registrations_racing_old_commits_never_leave_an_abandoned_row_committed(catalog_url):
    rounds = 20
    with Catalog(catalog_url) as catalog:
        catalog.ensure_run("r", "/c")
        register(catalog, "r", 1)
    with Catalog(catalog_url) as old, Catalog(catalog_url) as new:
        outcomes = Counter(_race_once(old, new, epoch) for epoch in range(1, rounds + 1))
        assert _abandoned_but_committed(new, "r") == []
    assert sum(outcomes.values()) == rounds
    assert set(outcomes) <= {"refused", "committed then staled"}
