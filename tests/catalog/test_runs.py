"""Runs: create, ensure (the job's start-up call), update, get, and the one-query summary."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import event

from tests.catalog.conftest import commit_step
from zephon.catalog import (
    UNSET,
    Catalog,
    InvalidValueError,
    RunConflictError,
    RunExistsError,
    RunNotFoundError,
)


def test_ensure_run_creates_a_run_with_defaults(catalog):
    record = catalog.ensure_run("job-1", "s3://bucket/ckpt/job-1")
    assert (record.name, record.storage_url, record.kind, record.status) == (
        "job-1",
        "s3://bucket/ckpt/job-1",
        "train",
        "active",
    )
    assert (record.num_to_keep, record.keep_every_steps, record.total_steps) == (None,) * 3
    assert record.created_at.tzinfo is not None
    assert [e.action for e in catalog.events(run="job-1")] == ["run_created"]


def test_ensure_run_is_idempotent_and_applies_given_fields(catalog):
    catalog.ensure_run("job", "/ckpt/job", num_to_keep=3, total_steps=1000)
    again = catalog.ensure_run("job", "/ckpt/job/")  # trailing slash: same location
    assert (again.num_to_keep, again.total_steps) == (3, 1000)
    assert [e.action for e in catalog.events(run="job")] == ["run_created"]

    changed = catalog.ensure_run("job", "/ckpt/job", num_to_keep=None, config={"lr": 0.1})
    assert changed.num_to_keep is None and changed.config == {"lr": 0.1}
    assert changed.total_steps == 1000  # not given: unchanged
    updated = catalog.events(run="job")[0]
    assert updated.action == "run_updated"
    assert updated.detail == {"num_to_keep": None, "config": "<changed>"}


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [("storage_url", {"storage_url": "/elsewhere"}), ("kind", {"kind": "inference"})],
)
def test_ensure_run_refuses_a_name_registered_with_another_identity(catalog, field, kwargs):
    catalog.ensure_run("job", "/ckpt/job")
    arguments = {"storage_url": "/ckpt/job", **kwargs}
    with pytest.raises(RunConflictError) as caught:
        catalog.ensure_run("job", arguments.pop("storage_url"), **arguments)
    assert caught.value.field == field
    assert "'job'" in str(caught.value) and "use another run name" in str(caught.value)


def test_create_run_refuses_an_existing_name(catalog):
    catalog.create_run("job", "/ckpt/job", num_to_keep=2, keep_every_steps=100)
    with pytest.raises(RunExistsError, match="'job' already exists"):
        catalog.create_run("job", "/ckpt/job")


def test_get_run_of_an_unknown_name_says_how_to_find_runs(catalog):
    with pytest.raises(RunNotFoundError) as caught:
        catalog.get_run("nope")
    assert caught.value.run == "nope"
    assert "zephon runs" in str(caught.value) and "zephon sync" in str(caught.value)


def test_update_run_changes_only_the_given_fields(catalog):
    catalog.ensure_run("job", "/ckpt/job", num_to_keep=2, total_steps=10)
    updated = catalog.update_run("job", status="finished", keep_every_steps=5)
    assert (updated.status, updated.keep_every_steps, updated.num_to_keep) == ("finished", 5, 2)
    assert catalog.update_run("job", num_to_keep=UNSET).num_to_keep == 2
    assert catalog.get_run("job") == updated
    with pytest.raises(RunNotFoundError):
        catalog.update_run("other", status="finished")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_to_keep": 0},
        {"num_to_keep": True},
        {"keep_every_steps": -5},
        {"total_steps": -1},
        {"status": "paused"},
        {"config": ["not", "a", "dict"]},
    ],
)
def test_invalid_run_fields_are_refused_before_touching_the_database(catalog, kwargs):
    catalog.ensure_run("job", "/ckpt/job")
    with pytest.raises(InvalidValueError) as caught:
        catalog.update_run("job", **kwargs)
    assert next(iter(kwargs)) in str(caught.value)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "x" * 129, "sp ace", "é"])
def test_invalid_run_names_are_refused(catalog, name):
    with pytest.raises(InvalidValueError, match=r"\[A-Za-z0-9._-\]"):
        catalog.ensure_run(name, "/ckpt")


def test_storage_urls_with_credentials_are_refused_and_masked(catalog):
    with pytest.raises(InvalidValueError) as caught:
        catalog.ensure_run("job", "s3://key:secretvalue@bucket/ckpt")
    assert "secretvalue" not in str(caught.value)
    assert "storage options" in str(caught.value)


def test_invalid_kind_is_refused(catalog):
    with pytest.raises(InvalidValueError, match="train, inference"):
        catalog.ensure_run("job", "/ckpt", kind="eval")


def test_list_runs_summarises_every_run_in_one_query(catalog):
    catalog.ensure_run("empty", "/ckpt/empty")
    catalog.ensure_run("busy", "/ckpt/busy", num_to_keep=5)
    catalog.ensure_run("done", "/ckpt/done", status="finished")
    for step in (10, 20, 30):
        commit_step(catalog, "busy", step, bytes=100)
    catalog.begin_checkpoint("busy", 40, "/ckpt/busy/save-40")
    failed = catalog.begin_checkpoint("busy", 50, "/ckpt/busy/save-50")
    catalog.mark_failed("busy", 50, failed.save_id, "disk full")
    commit_step(catalog, "done", 7, bytes=None)

    statements: list[str] = []

    def count(conn, cursor, statement, *args):
        if "runs" in statement or "checkpoints" in statement:
            statements.append(statement)

    engine = catalog._db.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        summaries = catalog.list_runs()
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert len(statements) == 1, statements

    by_name = {s.run.name: s for s in summaries}
    assert [s.run.name for s in summaries] == ["busy", "done", "empty"]
    busy = by_name["busy"]
    assert (busy.committed_count, busy.committed_bytes, busy.latest_step) == (3, 300, 30)
    assert busy.pending_count == 1
    assert busy.last_activity >= busy.run.updated_at
    assert (by_name["done"].committed_count, by_name["done"].committed_bytes) == (1, 0)
    empty = by_name["empty"]
    assert (empty.committed_count, empty.latest_step, empty.pending_count) == (0, None, 0)
    assert empty.last_activity == empty.run.updated_at

    assert [s.run.name for s in catalog.list_runs(status="finished")] == ["done"]
    json.dumps([s.to_dict() for s in summaries])  # what `zephon runs --json` prints


def test_a_custom_actor_is_recorded(catalog_url):
    with Catalog(catalog_url, actor="gc@cron") as catalog:
        catalog.ensure_run("job", "/ckpt/job")
        assert catalog.events(run="job")[0].actor == "gc@cron"


def test_the_default_actor_is_user_at_host_and_pid(catalog):
    import os
    import socket

    catalog.ensure_run("job", "/ckpt/job")
    actor = catalog.events(run="job")[0].actor
    assert actor.endswith(f"@{socket.gethostname()}:{os.getpid()}")


def test_record_event_appends_an_external_action(catalog):
    catalog.record_event("orphan_removed", run="job", step=3, detail={"path": "/x/save-3"})
    latest = catalog.events()[0]
    assert (latest.action, latest.run, latest.step) == ("orphan_removed", "job", 3)
    assert latest.detail == {"path": "/x/save-3"}
    with pytest.raises(InvalidValueError):
        catalog.record_event("")
