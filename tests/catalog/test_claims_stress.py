"""Three gc processes and a committing job on one run for a bounded time, on both databases.

One gc asks for every committed step (only the claim's re-check protects the run from it), two
claim what their retention plans say.

Checked afterwards: nothing errored; no row was claimed twice; every claim finished; no deleted
row was pinned, a milestone, or among the newest ``num_to_keep`` committed when it was claimed;
the newest ``num_to_keep`` are committed at the end; pending rows were never touched.
"""

from __future__ import annotations

import pytest

from tests.catalog import workers
from tests.catalog.conftest import commit_step
from zephon.catalog import Catalog

NUM_TO_KEEP = 3
KEEP_EVERY = 25
PINNED = 7
SECONDS = 3.0
#: the committer goes on past SECONDS until this many commits, however loaded the machine
LEAST_COMMITS = 40


@pytest.mark.slow
def test_gcs_and_a_committing_job_never_delete_what_must_be_kept(catalog_url, tmp_path):
    with Catalog(catalog_url) as catalog:
        catalog.ensure_run("s", "/c/s", num_to_keep=NUM_TO_KEEP, keep_every_steps=KEEP_EVERY)
        for step in range(1, 21):
            commit_step(catalog, "s", step)
        catalog.pin("s", PINNED)

    done = str(tmp_path / "committer-done")
    results = workers.run_in_processes(
        [(workers.stress_committer, (catalog_url, "s", 21, SECONDS, LEAST_COMMITS, done))]
        + [(workers.stress_gc, (catalog_url, "s", done, greedy)) for greedy in (1, 0, 0)]
    )
    (commits, pending), *gc_results = results
    claims = [entry for gc in gc_results for entry in gc]

    claimed_steps = [step for step, *_ in claims]
    # Enough happened to mean something: every commit beyond the kept, pinned and milestone
    # ones was claimed by the final passes at the latest.
    assert len(commits) >= LEAST_COMMITS and len(claims) > 20, (len(commits), len(claims))
    assert len(claimed_steps) == len(set(claimed_steps)), "a row was claimed twice"
    assert all(marked for *_, marked in claims), "a claim could not be finished"

    committed_before = {step: float("-inf") for step in range(1, 21)}
    committed_before.update({step: started for step, started, _ in commits})
    for step, _token, _started, claim_ended, _ in claims:
        assert step != PINNED and step % KEEP_EVERY != 0, step
        # Sound bound: a commit that had not even started when the claim returned cannot have
        # been visible to it. At least NUM_TO_KEEP newer commits must have been possible.
        newer = [s for s, t in committed_before.items() if s > step and t < claim_ended]
        assert len(newer) >= NUM_TO_KEEP, (step, sorted(newer))

    with Catalog(catalog_url) as catalog:
        rows = {c.step: c for c in catalog.list_checkpoints("s")}
    committed = sorted(s for s, c in rows.items() if c.state == "committed")
    newest = sorted(committed_before)[-NUM_TO_KEEP:]
    assert committed[-NUM_TO_KEEP:] == newest
    assert {s for s, c in rows.items() if c.state == "deleted"} == set(claimed_steps)
    assert not [s for s, c in rows.items() if c.state in ("deleting", "failed")]
    for step, attempt in pending:
        assert (rows[step].state, rows[step].save_id) == ("pending", attempt)
    assert rows[PINNED].state == "committed"
