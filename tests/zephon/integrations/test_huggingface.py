"""The Hugging Face Trainer and accelerate through Zephon, with the real packages and a tiny
Llama built from its config: a job SIGKILLed while saving resumes from the latest complete
checkpoint and logs exactly the losses of an uninterrupted run, through ``latest_checkpoint``
or through the Trainer's own ``resume_from_checkpoint=True`` (which without the callback
crashes on the half-written folder), also on a machine whose output folder is empty."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests import zygote
from tests.conftest import database_url, make_backend
from zephon.storage import CheckpointStore

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WORKER = os.path.join(HERE, "huggingface_worker.py")
MAX_STEPS = 24  # saves every 8 steps: 8, 16, 24
#: what the worker's processes are forked with, imported (tests/zygote.py)
PRELOAD = (*zygote.PRELOAD, "transformers.trainer", "transformers.models.llama.modeling_llama")


def run_worker(tmp_path, name: str, **spec) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run one training job; returns the process and its logged losses by step (None if it
    died before writing them)."""
    losses = tmp_path / f"losses-{name}.json"
    spec = {"max_steps": MAX_STEPS, "kill": "none", "resume": "none", **spec}
    spec["losses"] = str(losses)
    env = {**os.environ, "PYTHONPATH": REPO}
    done = zygote.run(
        [WORKER, json.dumps(spec)], cwd=tmp_path, env=env, timeout=120, preload=PRELOAD
    )
    return done, (json.loads(losses.read_text()) if losses.exists() else None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, str]:
    """The losses of an uninterrupted, seeded run, and its Zephon root (run "reference",
    checkpoints 8, 16 and 24)."""
    tmp = tmp_path_factory.mktemp("reference")
    done, losses = run_worker(
        tmp,
        "reference",
        output_dir=str(tmp / "out"),
        save_dir=str(tmp / "ckpt"),
        run="reference",
        catalog=None,
        storage_options={},
        num_to_keep=2,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses is not None and sorted(map(int, losses)) == list(range(1, MAX_STEPS + 1))
    kept = CheckpointStore(str(tmp / "ckpt")).run("reference").complete()
    assert [m.step for m in kept] == [16, MAX_STEPS]  # retention without a catalog
    return losses, str(tmp / "ckpt")


@pytest.fixture
def reference_losses(reference) -> dict:
    return reference[0]


def assert_same_losses(resumed: dict, reference: dict, first: int) -> None:
    for step in range(first, MAX_STEPS + 1):
        assert resumed[str(step)] == reference[str(step)], f"step {step}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("storage", "database", "kill"),
    [("local", "sqlite", "trainer_save"), ("s3", "postgresql", "zephon_commit")],
    ids=["local-in-trainer-save", "s3-before-the-marker"],
)
def test_sigkill_during_a_save_resumes_exactly_even_through_stock_resume(
    storage, database, kill, request, tmp_path, reference_losses
):
    """SIGKILL at step 16, inside the Trainer's own save (weights written, no
    trainer_state.json) or inside Zephon's (every file uploaded, no marker): step 8 is the
    latest complete checkpoint and resuming there replays steps 9..24 exactly, with the
    Trainer's own resume_from_checkpoint=True (the half-written folder moved aside) as with
    latest_checkpoint."""
    backend = make_backend(storage, request, tmp_path)
    with database_url(database, request, tmp_path) as catalog_url:
        common = {
            "output_dir": str(tmp_path / "out"),
            "save_dir": backend.url,
            "run": "llama",
            "catalog": catalog_url,
            "storage_options": backend.storage_options,
            "local_dir": str(tmp_path / "resume"),
            "num_to_keep": 2,
        }
        killed, _ = run_worker(tmp_path, "killed", kill=kill, kill_step=16, **common)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        partial = tmp_path / "out" / "checkpoint-16"
        store = CheckpointStore(backend.url, backend.storage_options)
        assert [m.step for m in store.run("llama").complete()] == [8]
        if kill == "zephon_commit":  # its files are there, uncommitted
            assert 16 in [listing.step for listing in store.run("llama").list_steps()]
            assert (partial / "trainer_state.json").exists()  # the Trainer's folder is whole
            mode = "zephon"
        else:  # the Trainer's own resume_from_checkpoint=True on the same output_dir
            assert not (partial / "trainer_state.json").exists()  # stock alone would crash
            mode = "stock"
        weights = tmp_path / "out" / "checkpoint-8" / "model.safetensors"
        written = weights.stat().st_ino  # the Trainer's own file, committed by the callback
        resumed, losses = run_worker(tmp_path, "resumed", resume=mode, **common)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "stock resume failed" not in resumed.stdout
        assert re.search(r"resuming from \S*checkpoint-8\n", resumed.stdout), resumed.stdout
        assert_same_losses(losses, reference_losses, first=9)
        # the uncommitted folder of step 16 was moved aside, not deleted
        (aside,) = (tmp_path / "out" / ".zephon-incomplete").iterdir()
        assert aside.name.startswith("checkpoint-16.") and (aside / "model.safetensors").exists()
        assert (aside / "trainer_state.json").exists() == (kill == "zephon_commit")
        # the committed folder of step 8 was checked again in place, not downloaded again
        assert weights.stat().st_ino == written

        assert [m.step for m in store.run("llama").complete()] == [16, MAX_STEPS]  # num_to_keep=2
        assert store.run("llama").lineage().current.resumed_from == 8
        from zephon.catalog import Catalog

        with Catalog(catalog_url) as catalog:
            rows = {row.step: row.state for row in catalog.list_checkpoints("llama")}
        assert rows[16] == rows[24] == "committed" and rows[8] == "deleted"


@pytest.mark.slow
def test_stock_resume_on_a_machine_with_an_empty_output_dir_resumes_from_the_store(
    s3_backend, tmp_path, reference_losses
):
    """The first job dies inside its save of step 24 on one machine; the next starts with an
    empty output_dir and only the store (S3) and the catalog, and the Trainer's own
    resume_from_checkpoint=True resumes from step 16 and replays steps 17..24 exactly."""
    common = {
        "save_dir": s3_backend.url,
        "run": "fresh-machine",
        "catalog": f"sqlite:///{tmp_path}/catalog.db",
        "storage_options": s3_backend.storage_options,
    }
    first = tmp_path / "first-machine"
    killed, _ = run_worker(
        tmp_path, "killed", output_dir=str(first), kill="trainer_save", kill_step=24, **common
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    fresh = tmp_path / "second-machine"
    resumed, losses = run_worker(
        tmp_path, "resumed", output_dir=str(fresh), resume="stock", **common
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {fresh}/checkpoint-16\n" in resumed.stdout, resumed.stdout
    assert max(map(int, losses)) == MAX_STEPS  # 1..16 come from the restored trainer_state
    assert_same_losses(losses, reference_losses, first=17)


@pytest.mark.slow
def test_latest_checkpoint_skips_a_damaged_checkpoint(tmp_path, reference):
    from zephon.integrations.huggingface import latest_checkpoint

    save_dir = str(tmp_path / "ckpt")
    shutil.copytree(reference[1], save_dir)
    newest = latest_checkpoint(save_dir, "reference")
    assert newest is not None and "save-24" in newest
    with open(os.path.join(newest, "optimizer.pt"), "r+b") as handle:  # one flipped byte
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 1]))
    fallback = latest_checkpoint(save_dir, "reference", local_dir=str(tmp_path / "dl"))
    assert fallback == str(tmp_path / "dl" / "checkpoint-16")
    state = json.loads((tmp_path / "dl" / "checkpoint-16" / "trainer_state.json").read_text())
    assert state["global_step"] == 16
    assert latest_checkpoint(save_dir, "no-such-run") is None


@pytest.mark.slow
def test_accelerate_save_and_load_round_trip_on_s3(s3_backend, tmp_path, sqlite_catalog):
    import torch
    from accelerate import Accelerator

    from zephon.integrations.accelerate import AcceleratorCheckpoints

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        return accelerator, model, optimizer

    def train(model, optimizer, steps):
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return loss.item()

    options = {"catalog": sqlite_catalog, "storage_options": s3_backend.storage_options}
    accelerator, model, optimizer = build()
    checkpoints = AcceleratorCheckpoints(
        accelerator, s3_backend.url, "acc", local_dir=str(tmp_path / "a"), **options
    )
    assert checkpoints.load_state() is None  # a fresh start
    train(model, optimizer, 3)
    checkpoints.save_state(3)
    expected = train(model, optimizer, 2)  # torch's RNG is part of the saved state
    checkpoints.close()

    accelerator, model, optimizer = build()
    again = AcceleratorCheckpoints(
        accelerator, s3_backend.url, "acc", local_dir=str(tmp_path / "b"), **options
    )
    assert again.load_state() == 3
    assert train(model, optimizer, 2) == expected
    again.save_state(5)
    again.close()
    rows = {row.step: row.state for row in sqlite_catalog.list_checkpoints("acc")}
    assert rows == {3: "committed", 5: "committed"}
    manifest = CheckpointStore(s3_backend.url, s3_backend.storage_options).run("acc").latest()
    assert manifest.step == 5 and manifest.metadata["framework"] == "accelerate"
    assert any(f.name == "optimizer.bin" for f in manifest.files)


@pytest.mark.slow
def test_accelerate_on_two_ranks_saves_every_ranks_files_and_resumes_exactly(s3_backend, tmp_path):
    """Two gloo ranks under torchrun on S3: each rank writes its own RNG state file; both are in
    the manifest, and a resumed job continues every rank's losses exactly. The ranks share a
    host, so one of them downloads the checkpoint, into a private temporary directory that is
    gone when the job ends."""
    worker = os.path.join(HERE, "huggingface_accelerate_worker.py")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    spec = {
        "save_dir": s3_backend.url,
        "storage_options": s3_backend.storage_options,
        "catalog": f"sqlite:///{tmp_path / 'catalog.db'}",
        "local_dir": None,
        "steps": 6,
    }

    def job(name: str, save_at: list[int]) -> tuple[list[dict], list[list[str]]]:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        args = json.dumps({**spec, "save_at": save_at, "losses": str(tmp_path / name)})
        done = subprocess.run(
            [*argv, worker, args],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(temporary)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads((tmp_path / f"{name}.{rank}.json").read_text()) for rank in (0, 1)], [
            json.loads((tmp_path / f"{name}.{rank}.downloads").read_text()) for rank in (0, 1)
        ]

    full, _ = job("full", save_at=[3])
    resumed, downloads = job("resumed", save_at=[])
    for rank in (0, 1):
        assert sorted(resumed[rank]) == ["4", "5", "6"]
        assert resumed[rank] == {k: v for k, v in full[rank].items() if int(k) > 3}
    assert full[0] != full[1]  # the ranks really drew different data
    manifest = CheckpointStore(s3_backend.url, s3_backend.storage_options).run("acc2").latest()
    names = {f.name for f in manifest.files}
    assert {"random_states_0.pkl", "random_states_1.pkl", "optimizer.bin"} <= names
    assert sorted(downloads[0]) == sorted(names) and downloads[1] == []  # one per host
    assert [p.name for p in temporary.iterdir() if p.name.startswith("zephon-")] == []


def test_the_callback_refuses_an_invalid_run_name():
    from zephon import ConfigError
    from zephon.integrations.accelerate import FolderCheckpoints

    with pytest.raises(ConfigError, match="run_name"):
        FolderCheckpoints("/tmp/unused", "no/slashes")
    with pytest.raises(ConfigError, match="num_to_keep = 0"):
        FolderCheckpoints("/tmp/unused", "ok", num_to_keep=0)


def test_a_run_name_taken_from_output_dir_follows_the_one_rule():
    from types import SimpleNamespace

    from zephon import ConfigError
    from zephon.integrations.huggingface import ZephonCallback

    callback = ZephonCallback("/tmp/unused")
    assert callback._run_name(SimpleNamespace(run_name=None, output_dir="/x/llama-tiny/")) == (
        "llama-tiny"
    )
    for output_dir in ("/x/save-5", "/x/_attempts", "/x/has space"):
        with pytest.raises(ConfigError, match="run_name='my-run'"):
            callback._run_name(SimpleNamespace(run_name=None, output_dir=output_dir))
