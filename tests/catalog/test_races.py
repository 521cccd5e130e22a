"""Races between threads and processes on the same rows: exactly one side wins each time."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from catalog import Catalog, StateConflictError
from tests.catalog import workers
from tests.catalog.conftest import commit_step


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

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(catalogs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for catalog in catalogs:
        catalog.close()

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
