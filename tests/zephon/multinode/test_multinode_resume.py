"""Two nodes that share nothing but S3 and PostgreSQL: train under torchrun, SIGKILL the node of
rank 0 mid-run, delete every node's directory, and resume on another layout from the catalog's
latest complete checkpoint. Every step's global batch (each lane's sample ids) and loss, and the
final model and optimizer, equal an uninterrupted run's bit for bit: the job
(``zephon.demo.elastic_job``) adds per-lane losses and gradients in lane order, so no result
depends on the number of ranks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from tests.servers import postgres_database
from tests.zephon.multinode.nodes import Cluster, read_json, read_steps
from zephon.catalog import Catalog
from zephon.demo.elastic_job import ElasticSpec

pytestmark = pytest.mark.slow

TOTAL, PERIOD, HOLD = 8, 2, 5  # killed after step 5: save-4 is the latest complete one
LANES, MICROBATCH = 4, 4


@dataclass
class Shared:
    """What the nodes share: a bucket on moto's S3 server and a PostgreSQL catalog."""

    bucket: str
    storage_options: dict[str, Any]
    catalog_url: str

    def spec(self, run: str) -> ElasticSpec:
        return ElasticSpec(
            save_dir=f"{self.bucket}/ckpt",
            catalog_url=self.catalog_url,
            storage_options=self.storage_options,
            run=run,
            total_steps=TOTAL,
            period_steps=PERIOD,
            num_to_keep=2,
            lanes=LANES,
            microbatch=MICROBATCH,  # no aggregate_dir: the pipeline aggregates over torch
        )


@pytest.fixture(scope="module")
def shared(s3, postgres_url) -> Iterator[Shared]:
    bucket = f"zt-multinode-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(bucket)
    with postgres_database(postgres_url) as catalog_url:
        yield Shared(f"s3://{bucket}", s3.storage_options(), catalog_url)


@dataclass
class Outcome:
    steps: dict[int, dict[str, Any]]
    final: dict[str, Any]


def load_final(results: Path) -> dict[str, Any]:
    return torch.load(results / "final.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(shared, tmp_path_factory) -> Outcome:
    """The uninterrupted run, in one plain process (no torch.distributed): one more layout,
    and the cheapest one to start."""
    with Cluster(tmp_path_factory.mktemp("reference")) as cluster:
        results = cluster.run(
            shared.spec("reference"), "reference", nnodes=1, nproc=1, torchrun=False
        )
    return Outcome(read_steps(results), load_final(results))


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    with Cluster(tmp_path) as opened:
        yield opened


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for index, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][index][key]), (index, key)


def test_the_reference_run_trains_on_one_microbatch_of_every_lane_per_step(reference):
    assert sorted(reference.steps) == list(range(1, TOTAL + 1))
    seen: list[str] = []
    for record in reference.steps.values():
        assert list(record["lanes"]) == [str(lane) for lane in range(LANES)]
        assert all(len(ids) == MICROBATCH for ids in record["lanes"].values())
        seen += [i for ids in record["lanes"].values() for i in ids]
    assert len(seen) == len(set(seen)) == TOTAL * LANES * MICROBATCH  # no record twice
    losses = [reference.steps[s]["loss"] for s in sorted(reference.steps)]
    assert losses[-1] < losses[0]  # it learns: the comparisons below compare something


@pytest.mark.parametrize(
    ("nnodes", "nproc"),
    [(1, 2), (2, 2)],
    ids=["2x1-to-1x2", "2x1-to-2x2"],
)
def test_a_node_killed_mid_run_resumes_on_another_layout_with_equal_batches_and_losses(
    shared, reference, cluster, nnodes, nproc
):
    spec = shared.spec(f"resume-{nnodes}x{nproc}")
    killed, launch = cluster.run_and_kill(
        replace(spec, hold_after_step=HOLD), "killed", nnodes=2, nproc=1
    )
    assert read_json(killed, "held.json")["step"] == HOLD
    # the other node lost its peer: it failed (or hung and was killed), it never finished
    assert all(code != 0 for code in launch.exit_codes), launch.exit_codes
    assert not any((cluster.base / f"node{i}").exists() for i in range(2))
    with Catalog(shared.catalog_url) as catalog:
        latest = catalog.latest_committed(spec.run)
    assert latest is not None and latest.step == 4  # step 5 was done but never saved

    resumed = cluster.run(spec, "resumed", nnodes=nnodes, nproc=nproc)

    start = read_json(resumed, "start.json")
    assert start["resumed_from"] == 4 and start["world"] == nnodes * nproc
    before, after = read_steps(killed), read_steps(resumed)
    assert sorted(before) == list(range(1, HOLD + 1))
    assert sorted(after) == list(range(5, TOTAL + 1))  # step 5 again: it was lost
    # global batches (every lane's sample ids) and losses, bit for bit
    assert before == {s: reference.steps[s] for s in before}
    assert after == {s: reference.steps[s] for s in after}
    assert_same_state(reference.final, load_final(resumed))
    with Catalog(shared.catalog_url) as catalog:
        assert catalog.latest_committed(spec.run).step == TOTAL
        assert catalog.get_run(spec.run).status == "finished"
    # the pipeline's progress went through torch.distributed: the bucket holds checkpoints only
    bucket = fsspec.filesystem("s3", skip_instance_cache=True, **shared.storage_options)
    assert bucket.ls(shared.bucket) == [shared.bucket.removeprefix("s3://") + "/ckpt"]
