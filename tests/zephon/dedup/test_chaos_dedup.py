"""Deduplicated saves under chaos and under fencing (docs/dedup.md, "Which chunks are removed,
and why it is safe").

- Chaos (slow): saving jobs and gc processes SIGKILLed at random and at exact kill points
  (tests/zephon/dedup/chaos.py, the same driver as benchmarks/dedup_chaos.py); after every
  kill every checkpoint of the lineage verifies deep and the latest loads bit for bit.
- The fenced rule (quick, deterministic): a stale attempt's chunks are garbage, never a reason
  to keep or delete the current attempt's; an old attempt's committed checkpoint still in the
  lineage keeps its chunks.
- A save in flight beside ``gc --grace 0``: what the CLI promises ("a save in progress is
  protected whatever it says") against what the sweep does.
"""

from __future__ import annotations

import datetime as dt
import random

import pytest

from tests.conftest import make_backend
from tests.zephon.dedup.chaos import ChaosConfig, run_chaos
from tests.zephon.saves import start
from tests.zephon.test_composition import make_run
from zephon.catalog import Catalog
from zephon.errors import StaleAttemptError
from zephon.gc import GcPolicy, collect_garbage
from zephon.saving import Save
from zephon.storage.backend import list_files

KIB = 1 << 10


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path):
    return make_backend(request.param, request, tmp_path)


@pytest.fixture
def catalog(tmp_path):
    with Catalog(f"sqlite:///{tmp_path / 'catalog.db'}") as opened:
        yield opened


def chunk_names(location) -> set[str]:
    chunk_dir = location.runstore.layout.chunk_dir
    return {f.path.rsplit("/", 1)[-1] for f in list_files(location.store.location, chunk_dir)}


def dedup_save(attempt, step: int, catalog, files: dict[str, bytes], base=None) -> Save:
    """A deduplicated save begun and written, not committed: its chunks uploaded, against
    ``base`` (a manifest: the newest committed checkpoint of the attempt's history)."""
    save = Save.begin(attempt, step, catalog=catalog)
    save.writer.deduplicate({c.sha256: c for c in base.chunk_refs()} if base else {})
    for name, data in files.items():
        with save.writer.open_chunked(name) as out:
            for start_at in range(0, len(data), 64 * KIB):  # one chunk per 64 KiB written
                out.write(data[start_at : start_at + 64 * KIB])
    return save


def commit(save: Save):
    manifest = save.commit()
    save.committed()
    return manifest


def gc(backend, catalog: Catalog, grace: dt.timedelta = dt.timedelta(days=1)):
    """One ``zephon gc`` pass over the run (its retention, leftovers and chunk sweep)."""
    policy = GcPolicy(grace=grace, events_age=None)
    options = backend.storage_options
    report = collect_garbage(catalog, runs=["r"], policy=policy, storage_options=options)
    assert not report.problems, report.problems
    return report


FROZEN = random.Random(0).randbytes(128 * KIB)  # the same in every save: two chunks
ADAPTER = {1: b"\x01" * 64 * KIB, 2: b"\x02" * 64 * KIB, 3: b"\x03" * 64 * KIB}


def test_a_stale_attempts_chunks_are_swept_and_the_current_attempts_are_kept(backend, catalog):
    location = make_run(catalog, backend, num_to_keep=2)
    old = start(location, catalog)
    first = commit(dedup_save(old, 1, catalog, {"w.bin": FROZEN + ADAPTER[1]}))
    # the old attempt uploads step 2's new chunk; a new attempt takes over from step 1
    stale = dedup_save(old, 2, catalog, {"w.bin": FROZEN + ADAPTER[2]}, base=first)
    stale_chunks = {p.rsplit("/", 1)[-1] for p in stale.writer._chunks.uploaded}
    assert len(stale_chunks) == 1
    new = start(location, catalog, resumed_from=1)
    # the new attempt's step 2, in flight: the same content, its own instance
    current = dedup_save(new, 2, catalog, {"w.bin": FROZEN + ADAPTER[2]}, base=first)
    current_chunks = {p.rsplit("/", 1)[-1] for p in current.writer._chunks.uploaded}
    assert len(current_chunks) == 1 and current_chunks != stale_chunks
    assert {n.split(".")[0] for n in current_chunks} == {n.split(".")[0] for n in stale_chunks}

    gc(backend, catalog)  # a day's grace: only the fenced rule (and markers) decide
    present = chunk_names(location)
    assert not stale_chunks & present, "a fenced-out attempt's unreferenced chunk is garbage"
    assert current_chunks <= present, "the current attempt's save in flight keeps its chunks"
    referenced = {c.name for c in first.chunk_refs()}
    assert referenced <= present, "the old attempt's committed step 1 keeps its chunks"

    with pytest.raises(StaleAttemptError):
        stale.commit()  # fenced: its marker never appears
    stale.writer.abort()
    second = commit(current)
    assert location.runstore.committed_steps() == [1, 2]
    for step in (1, 2):
        location.runstore.verify(step, deep=True).raise_for_problems()
    assert {c.name for c in second.chunk_refs()} <= chunk_names(location)


def test_an_old_attempts_checkpoint_in_the_lineage_keeps_its_chunks_until_nothing_names_them(
    backend, catalog
):
    location = make_run(catalog, backend, num_to_keep=2)
    old = start(location, catalog)
    first = commit(dedup_save(old, 1, catalog, {"w.bin": FROZEN + ADAPTER[1]}))
    old_instances = {c.name for c in first.chunk_refs()}
    assert {c.save_id for c in first.chunk_refs()} == {first.save_id}
    new = start(location, catalog, resumed_from=1)
    assert new.epoch > first.epoch
    gc(backend, catalog, grace=dt.timedelta(0))  # nothing in flight: the harshest gc
    assert old_instances <= chunk_names(location), "step 1 is in the lineage: its chunks stay"

    # the new attempt's saves list the old attempt's frozen instances (epoch 1 < epoch 2)
    second = commit(dedup_save(new, 2, catalog, {"w.bin": FROZEN + ADAPTER[2]}, base=first))
    third = commit(dedup_save(new, 3, catalog, {"w.bin": FROZEN + ADAPTER[3]}, base=second))
    frozen = {c.name for c in third.chunk_refs() if c.save_id == first.save_id}
    assert len(frozen) == 2, "the frozen bytes are step 1's instances"
    location.runstore.delete(1)  # what retention does to step 1 now: its marker goes first
    gc(backend, catalog, grace=dt.timedelta(0))
    present = chunk_names(location)
    assert frozen <= present, "older epoch, but steps 2 and 3 name them"
    assert not (old_instances - frozen) & present, "step 1's own adapter chunk is garbage"
    for step in (2, 3):
        location.runstore.verify(step, deep=True).raise_for_problems()


def test_gc_with_grace_0_beside_a_deduplicated_save_in_flight_keeps_its_chunks(backend, catalog):
    """``zephon gc --grace``: "a save in progress is protected whatever it says"; gc.py: "--grace
    0 beside a live job is safe". Found by the chaos driver: the sweep's age rule removed the
    chunks a pending save uploaded (nothing at the commit notices: a deduplicated file has no
    payload file to list); the sweep now spares the saves of the catalog's live rows."""
    location = make_run(catalog, backend, num_to_keep=2)
    attempt = start(location, catalog)
    save = dedup_save(attempt, 1, catalog, {"w.bin": FROZEN + ADAPTER[1]})
    gc(backend, catalog, grace=dt.timedelta(0))  # beside the live job, as the CLI says is safe
    commit(save)
    location.runstore.verify(1, deep=True).raise_for_problems()


@pytest.mark.slow
@pytest.mark.parametrize("name, kills", [("local", 15), ("s3", 10)])
def test_no_violation_across_random_kills_of_the_saver_and_gc(name, kills, request, tmp_path):
    backend = make_backend(name, request, tmp_path)
    config = ChaosConfig(
        url=backend.url,
        storage_options=backend.storage_options,
        workdir=str(tmp_path / "chaos"),
        kills=kills,
        seed=kills,
        grace_s=60.0,  # above any save of this job (a save in flight is younger: docs/dedup.md)
        saves=(3, 5),
    )
    result = run_chaos(config)
    assert not result.violations, result.violations
    assert not result.errors, result.errors
    assert sum(r.killed for r in result.rounds) == kills
    assert result.kills["saver"] and result.kills["gc"], result.kills
    for r in result.rounds:  # a job whose gc was killed made every save, and it is the latest
        if r.victim == "gc":
            assert len(r.saved) == r.saves and r.latest == r.saved[-1], r
    assert result.unreferenced_chunks == 0, result.unreferenced_chunk_bytes
