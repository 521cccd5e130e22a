"""The local tier on 2 gloo ranks with a real S3 save_dir (moto, behind
``benchmarks/latency_proxy.py``'s proxy, which counts every request and can slow them down) and
a SQLite or PostgreSQL catalog.

Each start of the job is ``tests/zephon/tier/tier_worker.py`` on 2 processes (started by
``tests.ranks.launch``), running a script of saves, waits and loads; the
tests assert on what the ranks reported, on both stores and on the catalog:

- one node, a shared local_dir (sync and async saves): every save is committed locally and
  uploaded; the save_dir copy equals the local one byte for byte; a resume loads from the local
  tier without one GET of the save_dir's payload (deleted before the resume: a load from
  save_dir could not succeed);
- two "nodes" (rank r's local_dir is ``node<r>``): the upload commits every rank's files; a
  resume loads from save_dir, with the same local_dirs (no disk holds the whole checkpoint) and
  with fresh ones;
- both ranks SIGKILLed while the upload of their last step is pending (the proxy adds 200 ms to
  every request): the next start resumes from the newest step held locally when the local_dir
  survived (L > R, and uploads it), from the newest uploaded one when it did not; the catalog's
  replica rows say which step was never uploaded;
- two attempts: the old one, still running with an upload pending, commits nothing once the new
  one registered; the new attempt's checkpoints are intact and a resume loads their tensors.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.latency_proxy import LatencyProxy
from tests.conftest import Backend, database_url, make_backend
from tests.ranks import launch, store_config
from zephon.catalog import Catalog
from zephon.storage import CheckpointStore

MODULE = "tests.zephon.tier.tier_worker"
WORLD = 2
#: added to every S3 request while an upload must stay pending
SLOW_MS = 200
#: the old attempt's delay while the new one starts: its upload's ~15 requests one after
#: another cannot finish before a start, however loaded the machine
HELD_MS = 5000

pytestmark = pytest.mark.slow


# -- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture
def bucket(request, tmp_path) -> Backend:
    """A fresh S3 save_dir on moto (the test process's own view: no proxy)."""
    return make_backend("s3", request, tmp_path)


@pytest.fixture
def proxy(s3) -> Iterator[LatencyProxy]:
    with LatencyProxy(s3.endpoint_url, 0) as running:
        yield running


def via(backend: Backend, proxy: LatencyProxy) -> Backend:
    """The same save_dir, reached through ``proxy`` (what the ranks use)."""
    options = {**backend.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}
    return replace(backend, storage_options=options)


def start(monkeypatch, backend: Backend, config: dict[str, Any]) -> list[dict]:
    """One start of the job on 2 ranks; every rank's RESULT record."""
    monkeypatch.setenv("ZEPHON_TIER_TEST", json.dumps(config))
    return launch(MODULE, WORLD, store_config(backend))


@contextlib.contextmanager
def running(monkeypatch, backend: Backend, config: dict) -> Iterator[concurrent.futures.Future]:
    """``start`` in a thread, its ranks' records the future's result. On the way out, also
    after a failed assertion, every file the script awaits is created (so its ranks finish
    instead of waiting out their timeout) and the start is waited for. ``launch`` reads the
    environment as it starts the processes: change ZEPHON_TIER_TEST again only after they
    reported something."""
    monkeypatch.setenv("ZEPHON_TIER_TEST", json.dumps(config))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(launch, MODULE, WORLD, store_config(backend))
        try:
            yield future
        finally:
            for action, *args in config["script"]:
                if action == "await":
                    (Path(config["sync_dir"]) / args[0]).touch()


def wait_for(sync_dir: Path, name: str, timeout: float = 90) -> None:
    """Until every rank created ``<name>-r<rank>``."""
    deadline = time.monotonic() + timeout
    paths = [sync_dir / f"{name}-r{rank}" for rank in range(WORLD)]
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"the ranks did not signal {name!r} in {timeout} s"
        time.sleep(0.05)


def actions(record: dict) -> dict[str, dict]:
    """A rank's recorded actions by their text (``"save 2 a"``); a repeated one keeps its
    first record, later ones get ``#2``, ``#3``."""
    out: dict[str, dict] = {}
    for done in record["actions"]:
        key = " ".join(str(a) for a in done["action"])
        n = 2
        while key in out:
            key, n = f"{' '.join(str(a) for a in done['action'])} #{n}", n + 1
        out[key] = done
    return out


def succeeded(ranks: list[dict]) -> None:
    for record in ranks:
        failed = [a for a in record["actions"] if "error" in a]
        assert not failed, (record["rank"], failed)


def assert_loaded(ranks: list[dict], step: int) -> None:
    """Every rank loaded ``step`` with the tensors and plain values its save had."""
    for record in ranks:
        loads = [a for a in record["actions"] if a["action"][0] == "load"]
        assert loads and "error" not in loads[0], (record["rank"], loads)
        got = loads[0]["ok"]
        assert got["step"] == step, (record["rank"], got)
        assert got["differing"] == [], (record["rank"], got)
        tag = loads[0]["action"][1]
        assert got["extra"] == {"rank": record["rank"], "tag": tag, "step": step}


def payload_gets(proxy: LatencyProxy, store: CheckpointStore, run: str, step: int) -> list[str]:
    """The GETs the proxy saw of the save_dir's payload files of ``step`` (not its marker)."""
    payload = store.run(run).read_manifest(step).payload
    return [
        line
        for line in proxy.request_lines
        if line.startswith("GET ") and f"/{run}/save-{step}/{payload}/" in line
    ]


def replica_states(catalog_url: str, run: str, tier: str) -> dict[int, str]:
    with Catalog(catalog_url) as catalog:
        return {r.step: r.state for r in catalog.replicas(run, tier=tier)}


def same_files(a: CheckpointStore, b: CheckpointStore, run: str, step: int) -> list[str]:
    """The file names of both copies of ``step``, after checking they are equal byte for byte
    and list the same sizes and CRCs."""
    ma, mb = a.run(run).read_manifest(step), b.run(run).read_manifest(step)
    entries_a = sorted((e.name, e.size, e.crc32c) for e in ma.files)
    entries_b = sorted((e.name, e.size, e.crc32c) for e in mb.files)
    assert entries_a == entries_b
    ra, rb = a.run(run).reader(step), b.run(run).reader(step)
    for name, _, _ in entries_a:
        assert ra.read_bytes(name) == rb.read_bytes(name), name
    return [name for name, _, _ in entries_a]


def every_ranks_files(names: list[str]) -> None:
    for rank in range(WORLD):
        assert f"ranks/{rank}.json" in names, names
        assert any(n.startswith(f"dcp/__{rank}_") for n in names), (rank, names)


def save_script(*steps: int, tag: str = "a") -> list[list[Any]]:
    script: list[list[Any]] = []
    for step in steps:
        script += [["save", step, tag], ["wait"]]
    return [*script, ["close"]]


# -- one node, a shared local_dir --------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_shared_local_dir_uploads_equal_copies_and_resumes_without_reading_save_dir(
    monkeypatch, bucket, proxy, tmp_path, async_save
):
    run, local_dir = "shared", tmp_path / "local"
    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    config = {
        "run": run,
        "catalog_url": catalog_url,
        "local_dir": str(local_dir),
        "sync_dir": str(sync_dir),
        "async_save": async_save,
    }
    script = [*save_script(1, 2), ["signal", "saved"], ["await", "deleted"]]
    script += [["reopen", str(local_dir)], ["load", "a"]]  # a new start of the job
    with running(monkeypatch, via(bucket, proxy), {**config, "script": script}) as job:
        wait_for(sync_dir, "saved")
        remote, local = bucket.open_store(), CheckpointStore(str(local_dir))
        assert remote.run(run).committed_steps() == [1, 2]
        assert local.run(run).committed_steps() == [2]  # local_num_to_keep: 1, and 1 was uploaded
        every_ranks_files(same_files(local, remote, run, 2))
        assert remote.run(run).verify(2, deep=True).ok
        assert replica_states(catalog_url, run, "save_dir") == {1: "committed", 2: "committed"}
        assert replica_states(catalog_url, run, "local") == {1: "deleted", 2: "committed"}

        # Without its payload on save_dir, step 2 can only load from the local tier.
        payload = remote.run(run).read_manifest(2).payload
        remote.location.fs.rm(f"{remote.run(run).checkpoint_path(2)}/{payload}", recursive=True)
        proxy.reset()
        (sync_dir / "deleted").touch()
        ranks = job.result()
    succeeded(ranks)
    assert_loaded(ranks, 2)
    assert payload_gets(proxy, remote, run, 2) == []


# -- two nodes, each its own local_dir ---------------------------------------------------------


def test_per_node_local_dirs_upload_every_ranks_files_and_resume_from_save_dir(
    monkeypatch, bucket, proxy, tmp_path
):
    run = "nodes"
    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = {"run": run, "catalog_url": catalog_url, "local_dir": str(tmp_path / "node{rank}")}
    succeeded(start(monkeypatch, via(bucket, proxy), {**config, "script": save_script(1, 2)}))

    remote = bucket.open_store()
    assert remote.run(run).committed_steps() == [1, 2]
    manifest = remote.run(run).read_manifest(2)
    names = [e.name for e in manifest.files]
    every_ranks_files(names)
    assert remote.run(run).verify(2, deep=True).ok
    reader = remote.run(run).reader(2)
    for entry in manifest.files:  # each file came from the node of the rank that wrote it
        copies = list(tmp_path.glob(f"node*/{run}/save-2/*/{entry.name}"))
        assert len(copies) == 1, (entry.name, copies)
        assert copies[0].read_bytes() == reader.read_bytes(entry.name)
    ranks_of = {n.split("/")[1].split(".")[0] for n in names if n.startswith("ranks/")}
    assert ranks_of == {"0", "1"}

    # The same node-local dirs (no disk holds the whole checkpoint), then fresh ones: both
    # starts load step 2 from save_dir.
    proxy.reset()
    script = [["load", "a"], ["signal", "same"], ["await", "counted"]]
    script += [["reopen", str(tmp_path / "fresh{rank}")], ["load", "a"]]
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    again = {**config, "sync_dir": str(sync_dir), "script": script}
    with running(monkeypatch, via(bucket, proxy), again) as job:
        wait_for(sync_dir, "same")
        assert payload_gets(proxy, remote, run, 2), "the same local dirs"
        proxy.reset()
        (sync_dir / "counted").touch()
        ranks = job.result()
    assert payload_gets(proxy, remote, run, 2), "fresh local dirs"
    succeeded(ranks)
    for record in ranks:
        loads = [a["ok"] for a in record["actions"] if a["action"][0] == "load"]
        assert [got["step"] for got in loads] == [2, 2]
        assert all(got["differing"] == [] for got in loads), loads


# -- a node dies with an upload pending --------------------------------------------------------


@pytest.mark.parametrize("local_dir_survives", [True, False], ids=["local-kept", "local-lost"])
def test_sigkill_with_an_upload_pending_resumes_from_what_survived(
    monkeypatch, bucket, proxy, tmp_path, local_dir_survives
):
    run, local_dir, sync_dir = "killed", tmp_path / "local", tmp_path / "sync"
    sync_dir.mkdir()
    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = {
        "run": run,
        "catalog_url": catalog_url,
        "local_dir": str(local_dir),
        "sync_dir": str(sync_dir),
    }
    script = [
        ["save", 1, "a"],
        ["wait"],
        ["signal", "uploaded1"],
        ["await", "slow"],
        ["save", 2, "a"],
        ["kill"],
    ]
    with running(monkeypatch, via(bucket, proxy), {**config, "script": script}) as job:
        wait_for(sync_dir, "uploaded1")
        proxy.delay_ms = SLOW_MS  # step 2's upload takes many requests: seconds
        (sync_dir / "slow").touch()
        killed = job.result()
    proxy.delay_ms = 0
    for record in killed:
        assert record["child_returncode"] == -9, record["stderr"]
        done = actions(record)
        assert "error" not in done["save 2 a"], done["save 2 a"]

    remote, local = bucket.open_store(), CheckpointStore(str(local_dir))
    assert remote.run(run).committed_steps() == [1]  # step 2 was never uploaded
    assert local.run(run).committed_steps()[-1] == 2  # (step 1 may still be there: it was uploaded)
    assert replica_states(catalog_url, run, "local").get(2) == "committed"
    assert replica_states(catalog_url, run, "save_dir").get(2) != "committed"

    if not local_dir_survives:
        shutil.rmtree(local_dir)
    ranks = start(
        monkeypatch,
        via(bucket, proxy),
        {**config, "script": [["load", "a"], ["wait"], ["close"]]},
    )
    succeeded(ranks)
    if local_dir_survives:  # L = 2 > R = 1: resumed from the local tier, and uploaded it
        assert_loaded(ranks, 2)
        assert remote.run(run).committed_steps() == [1, 2]
        assert remote.run(run).read_manifest(2).epoch == 2  # by the new attempt, its own fence
        same_files(local, remote, run, 2)
        assert replica_states(catalog_url, run, "save_dir").get(2) == "committed"
    else:
        assert_loaded(ranks, 1)
        assert remote.run(run).committed_steps() == [1]
        assert replica_states(catalog_url, run, "save_dir").get(2) != "committed"


# -- two attempts of one run -------------------------------------------------------------------


def test_an_old_attempt_with_uploads_pending_commits_nothing_after_a_new_one_registered(
    monkeypatch, request, bucket, s3, tmp_path
):
    run, sync_dir = "attempts", tmp_path / "sync"
    sync_dir.mkdir()
    old_script = [
        ["save", 1, "a"],
        ["wait"],
        ["signal", "uploaded1"],
        ["await", "slow"],
        ["save", 2, "a"],
        ["signal", "pending2"],
        ["await", "go"],
        ["save", 3, "a"],
        ["wait"],
        ["close"],
    ]
    new_script = [
        ["load", "a"],
        ["signal", "registered"],
        ["save", 2, "b"],
        ["wait"],
        ["save", 3, "b"],
        ["wait"],
        ["signal", "saved"],
        ["await", "checked"],  # then a third start of the job, on fresh local disks
        ["reopen", str(tmp_path / "third")],
        ["load", "b"],
    ]
    with (
        database_url("postgresql", request, tmp_path) as catalog_url,
        LatencyProxy(s3.endpoint_url, 0) as old_proxy,
        LatencyProxy(s3.endpoint_url, 0) as new_proxy,
        contextlib.ExitStack() as stack,
    ):
        config = {"run": run, "catalog_url": catalog_url, "sync_dir": str(sync_dir)}
        old_config = {**config, "local_dir": str(tmp_path / "old"), "script": old_script}
        old = stack.enter_context(running(monkeypatch, via(bucket, old_proxy), old_config))
        stack.callback(setattr, old_proxy, "delay_ms", 0)  # a failure below: let it finish
        wait_for(sync_dir, "uploaded1")
        old_proxy.delay_ms = HELD_MS  # the old attempt's upload of step 2 stays pending
        (sync_dir / "slow").touch()
        wait_for(sync_dir, "pending2")
        remote = bucket.open_store()
        assert remote.run(run).committed_steps() == [1]
        new_config = {**config, "local_dir": str(tmp_path / "new"), "script": new_script}
        new = stack.enter_context(running(monkeypatch, via(bucket, new_proxy), new_config))
        wait_for(sync_dir, "registered")
        old_proxy.delay_ms = 0  # the old attempt's uploads go on: every one must be refused
        (sync_dir / "go").touch()
        wait_for(sync_dir, "saved")
        old_ranks = old.result()
        # The old attempt learns it was fenced out: its pending uploads failed (raised by its
        # wait, or already by the next save or by close).
        old_done = old_ranks[0]["actions"]
        assert "error" not in old_done[1], old_done[1]  # step 1's upload, before the new one
        go = next(i for i, a in enumerate(old_done) if a["action"] == ["await", "go"])
        after_go = old_done[go + 1 :]
        refused = [a["error"]["type"] for a in after_go if "error" in a]
        assert "StaleAttemptError" in refused, after_go
        # Everything above step 1 on save_dir is the new attempt's, and intact.
        assert remote.run(run).committed_steps() == [1, 2, 3]
        for step in (2, 3):
            assert remote.run(run).read_manifest(step).epoch == 2, step
            assert remote.run(run).verify(step, deep=True).ok
        with Catalog(catalog_url) as catalog:
            for step in (2, 3):
                row = catalog.get_checkpoint(run, step)
                assert row.state == "committed"
                assert row.save_id == remote.run(run).read_manifest(step).save_id
        (sync_dir / "checked").touch()
        new_ranks = new.result()

    succeeded(new_ranks)
    for record in new_ranks:  # resumed from step 1, the old attempt's; then step 3, its own
        loads = [a for a in record["actions"] if a["action"][0] == "load"]
        assert [(a["ok"]["step"], a["ok"]["differing"]) for a in loads] == [(1, []), (3, [])]


# -- an uploader that dies ---------------------------------------------------------------------


def test_an_uploader_that_dies_on_one_rank_fails_every_rank_within_seconds(
    monkeypatch, bucket, tmp_path
):
    config = {
        "run": "broken",
        "catalog_url": None,
        "local_dir": str(tmp_path / "local"),
        "script": [
            ["save", 1, "a"],
            ["wait"],
            ["break_uploader", 1],
            ["save", 2, "a"],  # committed locally; rank 1's uploader dies uploading it
            ["wait"],
            ["save", 3, "a"],
        ],
    }
    ranks = start(monkeypatch, bucket, config)
    for record in ranks:
        done = actions(record)
        assert "error" not in done["save 1 a"] and "error" not in done["save 2 a"], done
        waited = done["wait #2"]
        assert waited["error"]["type"] == "UploaderDiedError", (record["rank"], waited)
        assert "rank 1" in waited["error"]["message"], waited
        assert "injected" in waited["error"]["message"], waited
        assert waited["seconds"] < 10, (record["rank"], waited)  # not the group's timeout
        refused = done["save 3 a"]
        assert refused["error"]["type"] in {"UploaderDiedError", "ZephonError"}, refused
        assert refused["seconds"] < 10, refused
    assert CheckpointStore(bucket.url, bucket.storage_options).run("broken").committed_steps() == [
        1
    ]
