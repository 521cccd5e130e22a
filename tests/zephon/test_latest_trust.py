"""``find_latest`` through the catalog answers from the catalog alone (no storage request) and
checks storage where the marker is read: request counts on moto's S3 server through the latency
proxy, and the safety rules when storage disagrees with the catalog's newest row (its marker
deleted, rewritten or condemned behind the catalog's back, its history abandoned by an attempt
the catalog missed), each ending with the right checkpoint loaded by the drop-in Reader and
by the checkpoint manager."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.zephon.saves import save_step, start
from tests.zephon.test_composition import make_run
from zephon import dcp as zd
from zephon.attempts import register
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig
from zephon.latest import find_latest
from zephon.locations import RunLocation
from zephon.storage import CheckpointNotFoundError, CheckpointStore

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from latency_proxy import LatencyProxy  # noqa: E402

SCENARIOS = ("marker deleted", "marker rewritten", "condemned on storage", "abandoned")
#: the state of step 20's catalog row once the lookup went past it
SETTLED = {
    "marker deleted": "deleted",
    "marker rewritten": "corrupt",
    "condemned on storage": "corrupt",
    "abandoned": "stale",
}


def proxied(backend, proxy: LatencyProxy) -> dict:
    options = json.loads(json.dumps(backend.storage_options))
    options["client_kwargs"]["endpoint_url"] = proxy.url
    return options


def test_latest_through_the_catalog_sends_no_storage_request(catalog, s3_backend):
    upstream = s3_backend.storage_options["client_kwargs"]["endpoint_url"]
    with LatencyProxy(upstream, 0) as proxy:
        store = CheckpointStore(s3_backend.url, proxied(s3_backend, proxy))
        catalog.ensure_run("r", store.location.canonical_url)
        location = RunLocation("r", store, "r")
        attempt = start(location, catalog)
        for step in (10, 20):
            saved = save_step(attempt, step, catalog)

        proxy.reset()
        latest = find_latest(location, catalog=catalog)
        assert (latest.step, latest.save_id, latest.confirmed) == (20, saved.save_id, False)
        assert proxy.requests == 0, proxy.request_lines
        # its manifest: the marker, the save's _CORRUPT record and the attempts, at once
        assert latest.manifest.checksum() == saved.checksum()
        assert proxy.requests == 3, proxy.request_lines
        proxy.reset()
        confirmed = find_latest(location, catalog=catalog, confirm=True)
        assert (confirmed.step, confirmed.confirmed, proxy.requests) == (20, True, 3)
        # a caller that read the lineage (a job start) needs no attempts listing
        lineage = store.run("r").lineage()
        proxy.reset()
        assert find_latest(location, catalog=catalog, lineage=lineage).confirmed
        assert proxy.requests == 2, proxy.request_lines
        store.close()


def test_a_latest_dcp_load_reads_the_marker_once(catalog, s3_backend):
    upstream = s3_backend.storage_options["client_kwargs"]["endpoint_url"]
    url = f"{s3_backend.url}/r"
    state = {"w": torch.arange(8.0)}
    with LatencyProxy(upstream, 0) as proxy:
        options = proxied(s3_backend, proxy)
        with zd.Writer(url, step=5, catalog=catalog, storage_options=options) as writer:
            zd.save(state, writer)
        counts = {}
        for step in (5, None):
            target = {"w": torch.zeros(8)}
            proxy.reset()
            with zd.Reader(url, step=step, catalog=catalog, storage_options=options) as reader:
                zd.load(target, reader)
            assert torch.equal(target["w"], state["w"]) and reader.step == 5
            counts[step] = proxy.request_lines
        marker_gets = [line for line in counts[None] if line.split()[1].endswith("/_COMMIT")]
        assert len(marker_gets) == 1, counts[None]
        # the latest load adds the _CORRUPT and attempts listings, sent with the marker's GET
        assert len(counts[None]) == len(counts[5]) + 2, (counts[None], counts[5])


# -- the safety rules ------------------------------------------------------------------------


def disagree(scenario: str, store: CheckpointStore, catalog: Catalog, step: int) -> None:
    """Make storage disagree with the catalog's row of ``step`` behind the catalog's back."""
    if scenario == "marker deleted":
        os.remove(store.run("r").marker_path(step))
    elif scenario == "marker rewritten":
        # the same save's marker with another CRC for a file: not the marker the row recorded
        path = store.run("r").marker_path(step)
        with open(path, "rb") as handle:
            body = json.loads(handle.read())
        body["files"][0]["crc32c"] = "AAAAAA=="
        with open(path, "w") as handle:
            handle.write(json.dumps(body, sort_keys=True, separators=(",", ":")))
    elif scenario == "condemned on storage":
        store.run("r").condemn(
            step, store.run("r").read_manifest(step), "found damaged by zephon verify"
        )
    else:  # a start that could not reach the catalog resumed from 10: 20 is abandoned
        location = RunLocation("r", store, "r")
        register(location, None, lineage=store.run("r").lineage(), resumed_from=10)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_drop_in_reader_loads_the_right_checkpoint(scenario, catalog, local_backend):
    url = f"{local_backend.url}/r"
    with zd.Writer(url, catalog=catalog) as writer:
        for step in (10, 20):
            values = {"w": torch.full((4,), float(step))}
            zd.save(values, writer, checkpoint_id=f"{url}/save-{step}")
    store = local_backend.open_store()
    disagree(scenario, store, catalog, 20)

    assert find_latest(RunLocation("r", store, "r"), catalog=catalog).step == 20  # trusted
    target = {"w": torch.zeros(4)}
    with zd.Reader(url, catalog=catalog) as reader:
        zd.load(target, reader)
    assert reader.step == 10 and torch.equal(target["w"], torch.full((4,), 10.0))
    assert catalog.get_checkpoint("r", 20).state == SETTLED[scenario]
    assert catalog.latest_committed("r").step == 10  # set aside for good: no loop


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_manager_loads_the_right_checkpoint(scenario, tmp_path):
    config = CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        period_steps=10,
        num_to_keep=None,
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
    )
    with CheckpointManager(config, run_name="r", total_steps=100) as manager:
        for step in (10, 20):
            manager.save(step, {"w": torch.full((4,), float(step)), "notes": {"step": step}})
    with Catalog(config.catalog_url) as catalog:
        disagree(scenario, CheckpointStore(config.save_dir), catalog, 20)
    state = {"w": torch.zeros(4), "notes": None}
    with CheckpointManager(config, run_name="r", total_steps=100) as manager:
        resume = manager.load_latest(state)
    assert resume.step == 10 and torch.equal(resume.values["w"], torch.full((4,), 10.0))
    with Catalog(config.catalog_url) as catalog:
        assert catalog.get_checkpoint("r", 20).state == SETTLED[scenario]


def test_a_lazy_answer_that_storage_does_not_bear_out_is_set_aside(catalog, local_backend):
    location = make_run(catalog, local_backend)
    attempt = start(location, catalog)
    for step in (10, 20):
        save_step(attempt, step, catalog)
    os.remove(location.store.run("r").marker_path(20))
    trusted = find_latest(location, catalog=catalog)
    assert trusted.step == 20
    with pytest.raises(CheckpointNotFoundError, match="look the latest checkpoint up again"):
        _ = trusted.manifest
    assert catalog.get_checkpoint("r", 20).state == "deleted"
    again = find_latest(location, catalog=catalog)
    assert again.step == 10 and again.manifest.step == 10


def test_a_row_whose_marker_another_save_replaced_is_repaired_to_that_save(catalog, local_backend):
    location = make_run(catalog, local_backend)
    attempt = start(location, catalog)
    save_step(attempt, 10, catalog)
    first = save_step(attempt, 20, catalog)
    location.store.run("r").delete_many([20])  # behind the catalog's back, then saved again
    second = save_step(attempt, 20, None, files={"w.bin": b"second save of 20"})
    assert second.save_id != first.save_id
    latest = find_latest(location, catalog=catalog)
    assert latest.step == 20 and latest.manifest.save_id == second.save_id  # verified first
    assert catalog.get_checkpoint("r", 20).save_id == second.save_id
    reader = location.store.run("r").reader(20)
    assert reader.read_bytes("w.bin") == b"second save of 20"
