"""A catalog outage does not kill a job (docs/catalog.md, "When the catalog is down"): saves
commit to storage under the storage fence, the catalog is brought up to date once it answers,
retention waits for it, a job start resumes from storage, and only an outage longer than
``catalog_outage_s`` fails the job, with one line. The catalog is a PostgreSQL server of the
tests' own that they stop and start (``stoppable_catalog``)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn

from tests.zephon.saves import save_step, start
from zephon import CatalogOutageError
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig, load_job_config
from zephon.errors import ConfigError
from zephon.gc import apply_retention
from zephon.locations import run_location
from zephon.outage import RETRY_IN_SAVE_S


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the catalog was not brought up to date in time"
        time.sleep(0.2)


def rows(catalog: Catalog, run: str) -> dict[int, str]:
    return {row.step: row.state for row in catalog.list_checkpoints(run)}


def test_a_save_during_an_outage_commits_to_storage_and_its_row_is_recorded_after(
    stoppable_catalog, tmp_path
):
    catalog = Catalog(stoppable_catalog.url())
    try:
        run = catalog.ensure_run("r", str(tmp_path / "ckpt"), num_to_keep=1)
        location = run_location(run, None)
        attempt = start(location, catalog)
        save_step(attempt, 10, catalog)
        with stoppable_catalog.cluster.outage():
            began = time.monotonic()
            save_step(attempt, 20, catalog)
            # bounded retries inside the save, then it goes on without the catalog
            assert time.monotonic() - began < RETRY_IN_SAVE_S + 5
            assert location.store.run("r").committed_steps() == [10, 20]
            assert apply_retention(location, catalog, attempt.fence, 1) == []  # never a guess
            began = time.monotonic()
            manifest = save_step(attempt, 30, catalog)
            assert time.monotonic() - began < RETRY_IN_SAVE_S  # a known outage: one try
            time.sleep(2)
        # the background payer records the rows, then runs the retention that waited
        wait_for(lambda: rows(catalog, "r") == {10: "deleted", 20: "deleted", 30: "committed"})
        row = catalog.get_checkpoint("r", 30)
        assert location.store.run("r").committed_steps() == [30]
        assert (row.save_id, row.epoch) == (manifest.save_id, attempt.epoch)
    finally:
        catalog.close()


def test_the_next_save_brings_the_catalog_up_to_date_before_its_own_row(
    stoppable_catalog, tmp_path
):
    catalog = Catalog(stoppable_catalog.url())
    try:
        location = run_location(catalog.ensure_run("r", str(tmp_path / "ckpt")), None)
        with stoppable_catalog.cluster.outage():
            attempt = start(location, catalog)  # claimed and decided on storage alone
            save_step(attempt, 5, catalog)
        save_step(attempt, 6, catalog)
        assert rows(catalog, "r") == {5: "committed", 6: "committed"}
        current = catalog.current_attempt("r")
        assert (current.epoch, current.decided) == (attempt.epoch, True)
    finally:
        catalog.close()


# -- a job -----------------------------------------------------------------------------------


def build():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(manager, model, optimizer, first, last) -> None:
    for step in range(first, last + 1):
        optimizer.zero_grad()
        model(torch.ones(3, 4)).pow(2).mean().backward()
        optimizer.step()
        manager.save(step, {"model": model, "optimizer": optimizer})


def job_config(tmp_path, url: str, outage_s: float, **kwargs) -> CheckpointingConfig:
    return CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        period_steps=1,
        catalog_url=url,
        catalog_outage_s=outage_s,
        **kwargs,
    )


def test_a_job_keeps_training_through_an_outage_shorter_than_the_deadline(
    stoppable_catalog, tmp_path
):
    config = job_config(tmp_path, stoppable_catalog.url(), 30, num_to_keep=2)
    with CheckpointManager(config, run_name="r", total_steps=20) as manager:
        model, optimizer = build()
        manager.load_latest({"model": model, "optimizer": optimizer})
        train(manager, model, optimizer, 1, 2)
        with stoppable_catalog.cluster.outage():
            train(manager, model, optimizer, 3, 5)
            # nothing is deleted without the catalog
            assert manager.store.run("r").committed_steps() == [1, 2, 3, 4, 5]
            time.sleep(2)
        train(manager, model, optimizer, 6, 6)  # after what the catalog missed is paid
        assert manager.store.run("r").committed_steps() == [5, 6]
        manager.finish()
    with Catalog(stoppable_catalog.url()) as catalog:
        committed = {step for step, state in rows(catalog, "r").items() if state == "committed"}
        assert committed == {5, 6}
        assert catalog.get_run("r").status == "finished"


def test_an_outage_longer_than_the_deadline_fails_the_job_with_one_line(
    stoppable_catalog, tmp_path
):
    config = job_config(tmp_path, stoppable_catalog.url(password="s3cret-pw"), 1.5)
    with CheckpointManager(config, run_name="r", total_steps=20) as manager:
        model, optimizer = build()
        train(manager, model, optimizer, 1, 1)
        with stoppable_catalog.cluster.outage():
            began = time.monotonic()
            with pytest.raises(CatalogOutageError) as caught:
                train(manager, model, optimizer, 2, 2)
            assert time.monotonic() - began < 1.5 + 5
        message = str(caught.value)
        assert "\n" not in message and "s3cret-pw" not in message
        assert f"127.0.0.1:{stoppable_catalog.cluster.port}" in message
        assert "catalog_outage_s = 1.5s" in message and "bring the database back" in message
        assert manager.store.run("r").committed_steps() == [1]  # the failed save left nothing


def test_a_resume_with_the_catalog_down_loads_the_latest_from_storage(
    stoppable_catalog, tmp_path, caplog
):
    config = job_config(tmp_path, stoppable_catalog.url(), 60)
    with CheckpointManager(config, run_name="r", total_steps=20) as manager:
        model, optimizer = build()
        train(manager, model, optimizer, 1, 3)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
    with stoppable_catalog.cluster.outage():
        caplog.set_level(logging.WARNING, logger="zephon")
        with CheckpointManager(config, run_name="r", total_steps=20) as manager:
            model, optimizer = build()
            resume = manager.load_latest({"model": model, "optimizer": optimizer})
            assert (resume.step, resume.next_step) == (3, 4)
            for key, value in model.state_dict().items():
                assert torch.equal(value, expected[key])
            scans = [r for r in caplog.records if "by a storage scan" in r.getMessage()]
            assert len(scans) == 1
            train(manager, model, optimizer, 4, 4)
            assert manager.store.run("r").committed_steps() == [1, 2, 3, 4]
            stoppable_catalog.cluster.start()
            train(manager, model, optimizer, 5, 5)
    with Catalog(stoppable_catalog.url()) as catalog:
        assert rows(catalog, "r") == {s: "committed" for s in range(1, 6)}
        current = catalog.current_attempt("r")
        assert (current.epoch, current.resumed_from) == (2, 3)


def test_catalog_outage_s_is_checked_and_read_from_the_job_yaml(tmp_path):
    tree = {"trainer": {"checkpointing": {"save_dir": "x", "catalog_outage_s": 90}}}
    assert load_job_config(tree).checkpointing.catalog_outage_s == 90.0
    assert CheckpointingConfig(save_dir="x").catalog_outage_s >= 60
    for bad in (0, -5, True, "60", 10**9):
        with pytest.raises(ConfigError, match=r"catalog_outage_s = .* is invalid"):
            CheckpointingConfig(save_dir="x", catalog_outage_s=bad)


def test_the_next_job_resumes_from_what_a_job_ended_during_an_outage_saved(
    stoppable_catalog, tmp_path
):
    config = job_config(tmp_path, stoppable_catalog.url(), 60)
    with CheckpointManager(config, run_name="r", total_steps=20) as manager:
        model, optimizer = build()
        train(manager, model, optimizer, 1, 2)
        stoppable_catalog.cluster.stop()
        train(manager, model, optimizer, 3, 3)  # committed on storage; the job then ends
    stoppable_catalog.cluster.start()
    with CheckpointManager(config, run_name="r", total_steps=20) as manager:
        model, optimizer = build()
        resume = manager.load_latest({"model": model, "optimizer": optimizer})
        assert resume.step == 3  # not 2, which would abandon what the last job saved
    with Catalog(stoppable_catalog.url()) as catalog:
        assert rows(catalog, "r") == {1: "committed", 2: "committed", 3: "committed"}


def test_the_dcp_writer_saves_through_an_outage_and_its_rows_follow(stoppable_catalog, tmp_path):
    from zephon import dcp as zd

    url = f"{tmp_path / 'ckpt'}/r"
    state = {"w": torch.arange(8.0)}
    with zd.Writer(url, catalog=stoppable_catalog.url(), num_to_keep=1) as writer:
        zd.save(state, writer, checkpoint_id=f"{url}/save-1")
        with stoppable_catalog.cluster.outage():
            zd.save(state, writer, checkpoint_id=f"{url}/save-2")
            assert writer.store.run("r").committed_steps() == [1, 2]  # retention waits
        zd.save(state, writer, checkpoint_id=f"{url}/save-3")
        assert writer.store.run("r").committed_steps() == [3]
    with Catalog(stoppable_catalog.url()) as catalog:
        assert rows(catalog, "r") == {1: "deleted", 2: "deleted", 3: "committed"}
