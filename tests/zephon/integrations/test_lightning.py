"""ZephonCheckpointIO with real Lightning: a tiny seeded model with dropout and a shuffled
DataLoader, SIGKILLed mid-run and mid-save (between the files and the marker), resumes with the
losses of an uninterrupted run; on local disk and S3; retention; nothing pickled."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("lightning")

from tests import zygote  # noqa: E402
from tests.conftest import database_url  # noqa: E402
from zephon.storage import CheckpointStore  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WORKER = os.path.join(HERE, "lightning_worker.py")
EPOCHS, STEPS_PER_EPOCH = 4, 4
#: what the worker's processes are forked with, imported (tests/zygote.py)
PRELOAD = (*zygote.PRELOAD, "lightning")


def run_worker(tmp, save_dir, run, *args, storage_options=None, killed=False):
    """Run the worker; returns its losses file. ``killed``: it must die of SIGKILL."""
    losses = os.path.join(tmp, "losses.txt")
    cmd = [WORKER, save_dir, run, losses, *args]
    if storage_options:
        cmd += ["--storage-options", json.dumps(storage_options)]
    env = {**os.environ, "PYTHONPATH": REPO}
    done = zygote.run(cmd, cwd=os.getcwd(), env=env, timeout=120, preload=PRELOAD)
    if killed:
        assert done.returncode == -9, done.stderr[-3000:]
    else:
        assert done.returncode == 0, done.stderr[-3000:]
    return losses


def read_losses(path) -> list[tuple[int, float]]:
    with open(path) as handle:
        return [(int(s), float(v)) for s, v in (line.split() for line in handle)]


def final_losses(path) -> dict[int, float]:
    """The loss of each step as the last process that ran it saw it."""
    return dict(read_losses(path))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    tmp = str(tmp_path_factory.mktemp("reference"))
    losses = run_worker(tmp, os.path.join(tmp, "ckpt"), "ref")
    found = read_losses(losses)
    assert [s for s, _ in found] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    return dict(found)


@pytest.mark.slow
def test_sigkill_mid_run_and_mid_save_resume_with_equal_losses_local(tmp_path, reference):
    tmp, save_dir = str(tmp_path), str(tmp_path / "ckpt")
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    run_worker(tmp, save_dir, "r", "--catalog", catalog, "--kill-at-step", "10", killed=True)
    # resumes from step 8 (the epoch-2 checkpoint), then dies between the files and the
    # marker of step 12
    run_worker(tmp, save_dir, "r", "--catalog", catalog, "--kill-in-save-of", "12", killed=True)
    store = CheckpointStore(save_dir)
    assert store.run("r").latest().step == 8
    losses = run_worker(tmp, save_dir, "r", "--catalog", catalog)
    steps = [s for s, _ in read_losses(losses)]
    assert steps == [*range(1, 11), *range(9, 13), *range(9, 17)]
    assert final_losses(losses) == reference
    assert store.run("r").latest().step == 16


@pytest.mark.slow
def test_sigkill_mid_run_and_mid_save_resume_with_equal_losses_on_s3_and_postgresql(
    tmp_path, request, s3_backend, reference
):
    tmp, url, options = str(tmp_path), s3_backend.url, s3_backend.storage_options
    with database_url("postgresql", request, tmp_path) as catalog:
        args = ["--catalog", catalog]
        run_worker(
            tmp, url, "s3run", *args, "--kill-at-step", "6", storage_options=options, killed=True
        )
        run_worker(
            tmp, url, "s3run", *args, "--kill-in-save-of", "8", storage_options=options, killed=True
        )
        losses = run_worker(tmp, url, "s3run", *args, storage_options=options)
        from zephon.catalog import Catalog

        with Catalog(catalog) as opened:
            committed = [r.step for r in opened.list_checkpoints("s3run", states="committed")]
    steps = [s for s, _ in read_losses(losses)]
    assert steps == [*range(1, 7), *range(5, 9), *range(5, 17)]
    assert final_losses(losses) == reference
    assert committed == [4, 8, 12, 16]


@pytest.mark.slow
def test_num_to_keep_and_save_top_k_reach_zephon_retention(tmp_path):
    tmp = str(tmp_path)
    keep_dir, topk_dir = str(tmp_path / "keep"), str(tmp_path / "topk")
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    run_worker(tmp, keep_dir, "keep", "--catalog", catalog, "--keep", "2", "--epochs", "3")
    assert [m.step for m in CheckpointStore(keep_dir).run("keep").complete()] == [8, 12]
    from zephon.catalog import Catalog

    with Catalog(catalog) as opened:
        rows = {r.step: r.state for r in opened.list_checkpoints("keep")}
    assert rows == {4: "deleted", 8: "committed", 12: "committed"}
    # save_top_k=1 on train_loss: Lightning saves steps 4 (as the best and as last.ckpt, one
    # checkpoint with two names) and 12 (better), then removes the name of step 4 through
    # remove_checkpoint; last.ckpt moved to 12, so step 4 is deleted
    run_worker(tmp, topk_dir, "topk", "--top-k", "1", "--epochs", "3")
    assert [m.step for m in CheckpointStore(topk_dir).run("topk").complete()] == [12]


def test_round_trip_stores_only_safetensors_and_json(tmp_path):
    import safetensors.torch
    import torch

    from zephon.integrations.lightning import LATEST, ZephonCheckpointIO
    from zephon.state_tree import StateEncodingError

    io = ZephonCheckpointIO(str(tmp_path / "ckpt"), "rt", num_to_keep=None)
    state = {
        "global_step": 3,
        "epoch": 0,
        "state_dict": {"w": torch.arange(6.0).reshape(2, 3)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}],
        "loops": {"fit_loop": {"epoch_progress": (1, 2)}},
        "pytorch-lightning_version": "2.6.6",
    }
    io.save_checkpoint(state, str(tmp_path / "names" / "a.ckpt"))
    loaded = io.load_checkpoint(LATEST)
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"])
    assert loaded["optimizer_states"][0]["state"][0]["step"].item() == 3.0
    assert loaded["loops"] == state["loops"]
    files = sorted(
        os.path.relpath(os.path.join(d, f), tmp_path / "ckpt" / "rt")
        for d, _, fs in os.walk(tmp_path / "ckpt" / "rt")
        for f in fs
    )
    payload = [f for f in files if f.startswith("save-3/e")]
    assert sorted(os.path.basename(f) for f in payload) == [
        "lightning.json",
        "tensors.safetensors",
    ]
    for name in payload:
        path = tmp_path / "ckpt" / "rt" / name
        if name.endswith(".json"):
            json.loads(path.read_text())
        else:
            assert set(safetensors.torch.load_file(path)) == {
                "state_dict/w",
                "optimizer_states/0/state/0/step",
            }
    with pytest.raises(StateEncodingError, match="hyper_parameters/module"):
        io.save_checkpoint(
            {**state, "global_step": 4, "hyper_parameters": {"module": object()}}, "b"
        )


def test_errors_are_one_line_and_name_the_fix(tmp_path):
    from zephon import CheckpointNotFoundError
    from zephon.errors import ConfigError, ZephonError
    from zephon.integrations.lightning import ZephonCheckpointIO

    with pytest.raises(ConfigError, match="num_to_keep = 0 is invalid"):
        ZephonCheckpointIO(str(tmp_path), "r", num_to_keep=0)
    with pytest.raises(ConfigError, match="run_name"):
        ZephonCheckpointIO(str(tmp_path), "../x")
    io = ZephonCheckpointIO(str(tmp_path), "r")
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint saved as 'nope.ckpt'") as info:
        io.load_checkpoint("nope.ckpt")
    assert "\n" not in str(info.value)
    with pytest.raises(ZephonError, match="global_step"):
        io.save_checkpoint({"state_dict": {}}, "a.ckpt")


@pytest.mark.parametrize("step", ["٤", "4 ", "-4", "+4", "4_0", "9" * 5000])
def test_a_ckpt_path_step_that_is_not_ascii_digits_is_refused_in_one_line(tmp_path, step):
    import torch

    from zephon.errors import ZephonError
    from zephon.integrations.lightning import ZephonCheckpointIO

    io = ZephonCheckpointIO(str(tmp_path), "r", num_to_keep=None)
    io.save_checkpoint({"global_step": 4, "epoch": 0, "state_dict": {"w": torch.ones(2)}}, "a")
    with pytest.raises(ZephonError, match="is not a checkpoint of run r") as caught:
        io.load_checkpoint(f"zephon://r/{step}")
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400
    assert io.load_checkpoint("zephon://r/4")["global_step"] == 4
