"""``zephon.dcp.Writer`` and ``Reader`` as drop-ins for torch DCP: real gloo ranks (2 and 4) on
local disk and S3 (moto), with and without a catalog (SQLite, PostgreSQL), a rank SIGKILLed
inside write_data, and the docs/dcp.md example run as printed.

Each configuration starts its ranks once (``tests/zephon/dcp/dropin_worker.py``); the tests
assert on what the ranks reported and on what storage and the catalog hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from tests.conftest import Backend, database_url, make_backend
from tests.ranks import launch, store_config
from tests.zephon.dcp.dropin_worker import RUN, empty_at, equal, state_at
from zephon import ConfigError
from zephon import dcp as zd
from zephon.catalog import Catalog
from zephon.storage import CheckpointNotFoundError


@dataclass
class Run:
    backend: Backend
    world: int
    catalog: str | None
    ranks: list[dict]

    @property
    def url(self) -> str:
        return f"{self.backend.url}/{RUN}"

    def store(self):
        return self.backend.open_store()


CONFIGS = [("local", 2, None), ("s3", 2, "sqlite"), ("local", 4, "postgresql")]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda p: f"{p[0]}-world{p[1]}-{p[2]}")
def run(request, tmp_path_factory):
    name, world, catalog = request.param
    tmp = tmp_path_factory.mktemp(f"dropin-{name}-{world}")
    backend = make_backend(name, request, tmp)
    if catalog is None:
        yield Run(backend, world, None, _launch(backend, world, None, "main"))
        return
    with database_url(catalog, request, tmp) as url:
        yield Run(backend, world, url, _launch(backend, world, url, "main"))


def _launch(backend: Backend, world: int, catalog: str | None, scenario: str, **kwargs):
    config = {**store_config(backend), "catalog": catalog, "scenario": scenario}
    return launch("tests.zephon.dcp.dropin_worker", world, config, timeout=120, **kwargs)


@pytest.mark.slow
def test_sync_async_and_reset_saves_commit_and_retention_keeps_two(run):
    assert run.ranks[0]["coordinator_committed"] == [1, 2, 3, 4]
    assert all(r["coordinator_committed"] == [] for r in run.ranks[1:])
    store = run.store()
    assert store.run(RUN).committed_steps() == [3, 4]  # num_to_keep=2; 5 failed, 6 was refused
    assert store.run(RUN).verify(4, deep=True).ok
    names = {e.name for e in store.run(RUN).read_manifest(4).files}
    assert {f"__{r}_0.distcp" for r in range(run.world)} <= names


@pytest.mark.slow
def test_step_none_loads_the_latest_and_checkpoint_id_another(run):
    for record in run.ranks:
        assert record["latest_step"] == 4 and record["latest_equal"]
        assert record["reset_step"] == 3 and record["reset_equal"]


@pytest.mark.slow
def test_ranks_disagreeing_on_step_or_run_raise_on_every_rank(run):
    for record in run.ranks:
        for key in ("step_disagreement", "run_disagreement"):
            error = record[key]
            assert error["raw"] == "CheckpointException"  # plain dcp.save: DCP's wrapper
            assert error["type"] == "WriterSetupError", error  # as_zephon_error unwraps it
            assert "ranks disagree" in error["message"]
        assert record["step_disagreement_zd"]["raw"] == "WriterSetupError"  # zephon.dcp.save
        error = record["reader_disagreement"]
        assert error["type"] == "ReaderDisagreementError", error
        assert "ranks disagree on the checkpoint to load" in error["message"]
    store = run.store()
    assert not store.run(RUN + "-0").list_steps() and 10 not in store.run(RUN).committed_steps()
    assert 10 + run.world - 1 not in [s.step for s in store.run(RUN).list_steps()]


@pytest.mark.slow
def test_a_storage_failure_on_one_rank_raises_on_every_rank_without_a_marker(run):
    for record in run.ranks:
        error = record["write_failure"]
        assert error["type"] == "BackendUnavailableError" and error["is_exception"], error
        assert "simulated" in error["message"]
    assert not run.store().run(RUN).is_committed(5)


@pytest.mark.slow
def test_a_second_writer_is_a_new_attempt_that_fences_out_the_first(run):
    for record in run.ranks:
        conflict = record["conflict"]
        if run.catalog is None:  # storage's begin refuses the step
            assert conflict["type"] == "CommitConflictError", conflict
        else:  # the catalog refuses it first, and its error reaches every rank as it is
            assert conflict["type"] == "CheckpointExistsError", conflict
        assert "never overwritten" in conflict["message"]
        assert record["stale"]["type"] == "StaleAttemptError", record["stale"]
    assert not run.store().run(RUN).is_committed(6)


@pytest.mark.slow
def test_the_catalog_records_every_save(run):
    if run.catalog is None:  # storage alone holds the same history
        assert run.store().run(RUN).committed_steps() == [3, 4]
        return
    with Catalog(run.catalog) as catalog:
        states = {row.step: row.state for row in catalog.list_checkpoints(RUN)}
        assert catalog.get_run(RUN).num_to_keep == 2
    assert states[3] == states[4] == "committed"
    assert states[1] == states[2] == "deleted"
    # 5 failed; the second Writer's registration (resuming from 4) then moved it to stale
    assert states[5] in {"failed", "stale"}


@pytest.mark.slow
def test_a_rank_killed_inside_write_data_leaves_no_marker_and_readers_take_the_last(
    request, tmp_path
):
    backend = make_backend("local", request, tmp_path)
    with database_url("sqlite", request, tmp_path) as catalog:
        ranks = _launch(backend, 2, catalog, "kill", allow_killed={1})
        assert ranks[0]["saved"] == [1]
        assert ranks[0]["killed_save"] is not None  # the survivor raised, it did not hang
        store = backend.open_store()
        assert not store.run(RUN).is_committed(2)
        assert [s.step for s in store.run(RUN).list_steps()] == [1, 2]  # 2: files, no marker
        for given in (catalog, None):
            with zd.Reader(f"{backend.url}/{RUN}", catalog=given) as reader:
                target = empty_at(0)
                dcp.load(target, storage_reader=reader)
            assert reader.step == 1
            assert equal(target, state_at(1, 0))


# -- one process: input checks, errors of plain dcp, the docs example ----------------------


def test_bad_input_gets_one_line_naming_it_and_the_fix(tmp_path):
    secret_url = "s3://AKIAEXAMPLE:supersecretvalue@bucket"
    cases = [
        (lambda: zd.Writer(secret_url), "no run component"),
        (lambda: zd.Writer(f"{tmp_path}/save-5"), "not a valid run name"),
        (lambda: zd.Writer(f"{tmp_path}/r", step=-1), "step = -1"),
        (lambda: zd.Writer(f"{tmp_path}/r", step="7"), "step = '7'"),
        (lambda: zd.Writer(f"{tmp_path}/r", num_to_keep=0), "num_to_keep = 0"),
        (lambda: zd.Writer(f"{tmp_path}/r", thread_count=0), "thread_count"),
        (lambda: zd.Writer(f"{tmp_path}/r", catalog=3), "catalog"),
        (lambda: zd.Reader(""), "url"),
    ]
    for make, words in cases:
        with pytest.raises(ConfigError) as info:
            make()
        message = str(info.value)
        assert words in message and "\n" not in message, message
        assert "supersecretvalue" not in message


def test_the_writer_takes_the_managers_retention_and_catalog_from_the_environment(
    tmp_path, monkeypatch
):
    """Retention is checked as every entry point's, and is the run's policy with a catalog
    (None included); without ``catalog=`` the Writer and the Reader use $ZEPHON_CATALOG_URL."""
    with pytest.raises(ConfigError, match="Writer keep_every_steps = 0 is invalid"):
        zd.Writer(f"{tmp_path}/r", keep_every_steps=0)
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    monkeypatch.setenv("ZEPHON_CATALOG_URL", url)
    run_url = f"{tmp_path}/ckpt/r"
    with zd.Writer(run_url, num_to_keep=1, keep_every_steps=2) as writer:
        for step in (1, 2, 3):
            zd.save(
                {"w": torch.full((2,), float(step))}, writer, checkpoint_id=f"{run_url}/save-{step}"
            )
        assert writer.store.run("r").committed_steps() == [2, 3]  # 2: a milestone
    with Catalog(url) as catalog:
        run = catalog.get_run("r")
        assert (run.num_to_keep, run.keep_every_steps) == (1, 2)
        assert {row.step for row in catalog.list_checkpoints("r", states="committed")} == {2, 3}
    with zd.Writer(run_url) as writer:  # the next job keeps every checkpoint, and says so
        zd.save({"w": torch.ones(2)}, writer, checkpoint_id=f"{run_url}/save-4")
    with Catalog(url) as catalog:
        run = catalog.get_run("r")
        assert (run.num_to_keep, run.keep_every_steps) == (None, None)
    reader = zd.Reader(run_url)
    with reader:
        target = {"w": torch.zeros(2)}
        dcp.load(target, storage_reader=reader)
        assert reader.step == 4 and reader._open_catalog() is not None  # the environment's


def test_plain_dcp_wraps_zephon_errors_and_zephon_dcp_raises_them(tmp_path):
    url = f"{tmp_path}/r"
    with zd.Writer(url) as writer:  # no step
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.ones(2)}, storage_writer=writer)
        assert isinstance(zd.as_zephon_error(info.value, where=url), zd.WriterSetupError)
        with pytest.raises(zd.WriterSetupError, match="no step to save"):
            zd.save({"w": torch.ones(2)}, writer)
        with pytest.raises(zd.WriterSetupError, match="not a checkpoint of this Writer's run"):
            zd.save({"w": torch.ones(2)}, writer, checkpoint_id=f"{tmp_path}/other/save-1")
        zd.save({"w": torch.ones(2)}, writer, checkpoint_id=f"{url}/save-1")
        with pytest.raises(zd.WriterSetupError, match="already committed"):
            zd.save({"w": torch.ones(2)}, writer)
    empty = zd.Reader(f"{tmp_path}/empty")
    with empty, pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        zd.load({"w": torch.zeros(2)}, empty)
    with zd.Reader(url) as reader:
        target = {"w": torch.zeros(2)}
        zd.load(target, reader)
        assert reader.step == 1 and torch.equal(target["w"], torch.ones(2))
