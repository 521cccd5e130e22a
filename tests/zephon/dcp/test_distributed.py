"""Real multi-process DCP through Zephon's writer and reader: gloo ranks on the CPU, world size 2
and 4, on local disk and on S3 (moto).

Each configuration starts its ranks once (``tests/zephon/dcp/worker.py`` runs every scenario);
the tests below assert on what the ranks reported and on what storage holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from tests.conftest import Backend, make_backend
from tests.ranks import launch, store_config
from tests.zephon.dcp.worker import RUN, build, flat, rank_tensors, state_of
from zephon import dcp as zd
from zephon.locations import stock_dcp_url

pytestmark = pytest.mark.slow


@dataclass
class Run:
    backend: Backend
    world: int
    ranks: list[dict]

    def store(self):
        return self.backend.open_store()


@pytest.fixture(
    scope="module",
    params=[("local", 2), ("s3", 2), ("local", 4), ("s3", 4)],
    ids=lambda p: f"{p[0]}-world{p[1]}",
)
def run(request, tmp_path_factory) -> Run:
    name, world = request.param
    backend = make_backend(name, request, tmp_path_factory.mktemp(f"dcp-{name}-{world}"))
    return Run(backend, world, launch("tests.zephon.dcp.worker", world, store_config(backend)))


def test_model_and_optimizer_load_bit_for_bit_into_fresh_modules(run):
    for record in run.ranks:
        assert record["differed_before_load"] > 0
        assert record["differ_after_load"] == []
        assert record["param_groups_equal"]


def test_a_dtensor_saved_as_rows_loads_into_a_column_layout(run):
    assert all(record["dtensor_resharded_equal"] for record in run.ranks)


def test_the_marker_lists_every_ranks_files_and_deep_verifies(run):
    store = run.store()
    manifest = store.run(RUN).read_manifest(1)
    names = [entry.name for entry in manifest.files]
    assert "dcp_metadata.json" in names
    for rank in range(run.world):
        assert any(name.startswith(f"__{rank}_") for name in names), (rank, names)
    assert set(names) == set(store.run(RUN).reader(1).names)
    report = store.run(RUN).verify(1, deep=True)
    assert report.ok, report.problems
    assert report.files_checked == len(names)


def test_only_the_coordinator_commits_and_sees_the_manifest(run):
    store = run.store()
    manifest = store.run(RUN).read_manifest(1)
    assert run.ranks[0]["committed_here"] == [manifest.file_count]
    assert all(record["committed_here"] == [] for record in run.ranks[1:])
    assert manifest.metadata["k"] == 1
    assert manifest.metadata["dcp"]["ranks"] == run.world
    assert run.ranks[0]["commit_metadata"] == manifest.metadata


def test_every_ranks_save_loads_in_one_process_with_torchs_stock_reader(run):
    # step 1: every rank's model and optimizer, its own keys, and a DTensor sharded by rows;
    # torch's stock reader in this one process loads what Zephon's reader loads, bit for bit
    # (the ranks' models may differ from one built here in the last bits: CPU threads)
    store = run.store()
    manifest = store.run(RUN).read_manifest(1)
    directory = stock_dcp_url(store.run(RUN).reader(1).url, manifest.payload, manifest.metadata)
    reader = (
        FileSystemReader(directory)
        if run.backend.name == "local"
        else FsspecReader(directory, **run.backend.storage_options)
    )

    def fresh() -> dict:
        model, optim = build(seed=2)
        state = {k: v for r in range(run.world) for k, v in state_of(model, optim, r).items()}
        state.update({f"rank{r}": rank_tensors(r, fill=-1.0) for r in range(run.world)})
        state["sharded"] = torch.zeros(run.world * 2, run.world * 3)
        return state

    stock, zephon = fresh(), fresh()
    dcp.load(stock, storage_reader=reader)
    zd.load(zephon, zd.ZephonStorageReader(store, RUN, 1))
    got, want = flat(stock), flat(zephon)
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert stock["optim"]["param_groups"] == zephon["optim"]["param_groups"]
    for r in range(run.world):
        assert all(torch.equal(stock[f"rank{r}"][k], v) for k, v in rank_tensors(r).items())
    torch.manual_seed(7)
    assert torch.equal(stock["sharded"], torch.randn(run.world * 2, run.world * 3))


def test_metadata_is_json_without_pickle(run):
    store = run.store()
    data = store.run(RUN).reader(1).read_bytes("dcp_metadata.json")
    body = json.loads(data)
    assert body["format"] == "zephon-dcp-metadata"
    assert b"\x80" not in data  # a pickle stream starts with the PROTO opcode
    assert body["state_dict_metadata"]["model.0.weight"]["dtype"] == "float32"


def test_a_rank_failing_in_write_data_fails_the_save_everywhere_without_a_marker(run):
    last = run.world - 1
    for record in run.ranks:
        error = record["failed_save"]
        assert error is not None
        assert error["type"] == "BackendUnavailableError", error
        assert "simulated" in error["message"] and f"__{last}_" in error["message"]
        assert record["step2_committed"] is False
    assert not run.store().run(RUN).is_committed(2)


def test_loading_an_uncommitted_checkpoint_is_refused_naming_the_marker(run):
    for record in run.ranks:
        error = record["uncommitted_load"]
        assert error["type"] == "CheckpointNotFoundError", error
        assert "_COMMIT" in error["message"] and "save-2" in error["message"]


@pytest.mark.parametrize("verify", [True, False])
def test_a_truncated_shard_is_refused_naming_the_file(run, verify):
    for record in run.ranks:
        error = record[f"corrupt_verify_{verify}"]
        assert error is not None, "a damaged checkpoint loaded"
        assert error["type"] == "CorruptCheckpointError", error
        assert record["victim"] in error["message"]


def test_a_wrong_shape_names_the_keys_on_every_rank(run):
    for record in run.ranks:
        error = record["wrong_shape"]
        assert error["type"] == "StateDictMismatchError", error
        assert error["shapes"] == ["model.0.bias", "model.0.weight", "model.2.weight"]
        assert "model.0.weight (checkpoint [32, 16], here [33, 16])" in error["message"]


def test_a_missing_key_is_named_on_every_rank(run):
    for record in run.ranks:
        error = record["missing_key"]
        assert error["type"] == "StateDictMismatchError", error
        assert "not_saved.w" in error["message"]


def test_async_save_keeps_the_state_as_staged_not_as_later_changed(run):
    for record in run.ranks:
        # DCP's default stager, then ZephonStager with fresh and with reused buffers
        assert record["async_copies_on_staging"] == [True, True, True]


def test_async_save_future_fails_on_every_rank_when_one_rank_fails(run):
    for record in run.ranks:
        error = record["failed_async"]
        assert error is not None and "simulated" in error["message"], error
        assert record["step4_committed"] is False
