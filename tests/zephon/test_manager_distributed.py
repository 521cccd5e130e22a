"""The checkpoint manager in real multi-process jobs (gloo, CPU): save, SIGKILL, resume, and the
resumed run equals an uninterrupted one bit for bit."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from tests.ranks import demo_ranks
from zephon.demo.job import JobSpec
from zephon.demo.launch import read_losses

#: the demo's ranks, forked from an interpreter that imported torch once (tests/zygote.py)
Ranks = demo_ranks()


def losses(spec: JobSpec, tag: str, rank: int) -> dict[int, float]:
    return read_losses(os.path.join(spec.out_dir, f"{tag}-losses-r{rank}.jsonl"))


def final(spec: JobSpec, tag: str, rank: int) -> dict:
    return torch.load(os.path.join(spec.out_dir, f"{tag}-final-r{rank}.pt"), weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for index, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            other = b["optimizer"]["state"][index][key]
            assert torch.equal(value, other), (index, key)
    assert a["task"] == b["task"] and a["metrics"] == b["metrics"]


def preempt_and_resume(base: JobSpec, world: int, kill_after: int) -> tuple[int, dict]:
    """Run uninterrupted (tag full), then a run killed after ``kill_after`` steps (tag a) and
    its resumption (tag b), on separate save directories."""
    full = replace(base, tag="full", save_dir=base.save_dir + "-full", run="full")
    Ranks(full, world).wait()
    interrupted = replace(base, tag="a", step_sleep_s=0.05)
    last = Ranks(interrupted, world).kill_after_step(kill_after)
    summary = Ranks(replace(base, tag="b"), world).wait()
    return last, summary


@pytest.fixture
def spec(tmp_path) -> JobSpec:
    return JobSpec(
        save_dir=str(tmp_path / "ckpt"),
        out_dir=str(tmp_path),
        total_steps=12,
        period_steps=3,
        num_to_keep=2,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("world", "async_save"), [(2, False), (4, False), (2, True)])
def test_sigkill_and_resume_equals_an_uninterrupted_run_locally(spec, world, async_save, tmp_path):
    spec = replace(spec, catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}", async_save=async_save)
    last, summary = preempt_and_resume(spec, world, kill_after=7)
    resumed_from = summary["resumed_from"]
    assert resumed_from is not None and resumed_from <= last and resumed_from % 3 == 0
    for rank in range(world):
        full, a, b = (losses(spec, t, rank) for t in ("full", "a", "b"))
        assert min(b) == resumed_from + 1 and max(b) == 12
        assert {s: full[s] for s in b} == b  # the next losses, bit for bit
        assert {s: full[s] for s in a} == a
        assert_same_state(final(spec, "full", rank), final(spec, "b", rank))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sigkill_and_resume_on_s3_with_postgres(spec, world, s3_backend, postgres_url):
    from tests.servers import postgres_database

    with postgres_database(postgres_url) as catalog_url:
        spec = replace(
            spec,
            save_dir=s3_backend.url + "/job",
            catalog_url=catalog_url,
            storage_options=s3_backend.storage_options,
        )
        last, summary = preempt_and_resume(spec, world, kill_after=5)
    for rank in range(world):
        full, b = losses(spec, "full", rank), losses(spec, "b", rank)
        assert min(b) == summary["resumed_from"] + 1
        assert {s: full[s] for s in b} == b
        assert_same_state(final(spec, "full", rank), final(spec, "b", rank))


def outputs(spec: JobSpec, tag: str, rank: int) -> dict[int, list[int]]:
    path = os.path.join(spec.out_dir, f"{tag}-outputs-r{rank}.jsonl")
    with open(path) as handle:
        return {r["step"]: r["ids"] for r in map(json.loads, handle)}


@pytest.mark.slow
def test_a_resumed_inference_job_skips_the_data_it_already_processed(tmp_path):
    world = 2
    spec = JobSpec(
        save_dir=str(tmp_path / "infer"),
        out_dir=str(tmp_path),
        kind="inference",
        run=None,
        total_steps=128,
        period_steps=16,
        num_to_keep=1,
    )
    Ranks(replace(spec, tag="a", step_sleep_s=0.02), world).kill_after_step(40)
    summary = Ranks(replace(spec, tag="b"), world).wait()
    resumed_from = summary["resumed_from"]
    assert resumed_from in (32, 48)
    # num_to_keep: 1; the attempt records of both starts beside it
    assert sorted(os.listdir(tmp_path / "infer")) == ["_attempts", "save-128"]
    records = sorted(os.listdir(tmp_path / "infer" / "_attempts"))  # claim + decision of each
    assert records == [f"{e:010d}{kind}" for e in (1, 2) for kind in (".json", ".resume.json")]
    every = []
    for rank in range(world):
        before = outputs(spec, "a", rank)
        after = outputs(spec, "b", rank)
        assert min(after) == resumed_from + 1 and max(after) == 128
        kept = [i for s in range(1, resumed_from + 1) for i in before[s]]
        every += kept + [i for ids in after.values() for i in ids]
    assert sorted(every) == list(range(2048))  # each record processed once, none skipped
    assert Ranks(replace(spec, tag="c"), world).wait()["finished"] is True


@pytest.mark.slow
def test_a_failure_on_one_rank_raises_on_every_rank_instead_of_hanging(tmp_path):
    import subprocess
    import sys

    from zephon.demo.launch import free_port

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_PORT": str(free_port())}
    argv = [
        sys.executable,
        "-m",
        "tests.zephon.failing_rank_child",
        json.dumps({"save_dir": str(tmp_path / "ckpt")}),
    ]
    procs = [
        subprocess.Popen(
            argv,
            cwd=repo,
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outcomes = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)  # a hang fails here
        assert proc.returncode == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    rank0, rank1 = outcomes
    assert "never with pickle" in rank1["save"]
    assert "rank 1 could not prepare the state of step 1" in rank0["save"]
    for outcome in outcomes:  # DCP's planning carries rank 1's mismatch to every rank
        assert outcome["load"].startswith("StateDictMismatchError")
        assert "model/weight (checkpoint [3, 3], here [4, 3])" in outcome["load"]
    # nothing of the failed save of step 1 is left; the attempt records stay beside save-2
    assert sorted(os.listdir(tmp_path / "ckpt" / "r")) == ["_attempts", "save-2"]
