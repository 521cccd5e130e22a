"""Operator slips that used to lose data (issue 19, item 6): a reader pointed at a training run
registered an attempt that abandoned its history (and gc then deleted every checkpoint); a job
that started over by mistake committed low steps into a run far ahead; a local tier configured
onto save_dir itself."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from zephon import SaveBelowLatestError
from zephon import dcp as zd
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager, export_safetensors
from zephon.cli import main as zephon_main
from zephon.config import CheckpointingConfig
from zephon.errors import ConfigError
from zephon.storage import CheckpointStore

RUN = "train"


def _train(save_dir: str, catalog_url: str, steps=(4, 8, 12)) -> nn.Module:
    """A training run of three checkpoints (through the manager, with a catalog)."""
    model = nn.Linear(3, 2)
    config = CheckpointingConfig(save_dir=save_dir, catalog_url=catalog_url, period_steps=4)
    with CheckpointManager(config, run_name=RUN, total_steps=100) as manager:
        manager.load_latest({"model": model})
        for step in steps:
            manager.save(step, {"model": model})
    return model


def _footprint(save_dir: str, catalog: Catalog) -> tuple:
    """What a reader must leave as it found it: the run's attempt records and catalog rows."""
    attempts = sorted(os.listdir(os.path.join(save_dir, RUN, "_attempts")))
    rows = sorted((r.step, r.state, r.save_id) for r in catalog.list_checkpoints(RUN))
    current = catalog.current_attempt(RUN)
    return attempts, rows, (current.epoch, current.resumed_from)


def test_readers_leave_no_attempt_decision_or_deletion_in_the_run_they_read(tmp_path, capsys):
    save_dir = str(tmp_path / "ckpt")
    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    _train(save_dir, catalog_url)
    run_dir = os.path.join(save_dir, RUN)
    with Catalog(catalog_url) as catalog:
        before = _footprint(save_dir, catalog)

        # an inference job pointed at the training run's folder (its own catalog name)
        config = CheckpointingConfig(save_dir=run_dir, catalog_url=catalog_url)
        with CheckpointManager(config, kind="inference", catalog_name="evals") as reader:
            reader.load_latest({"model": nn.Linear(3, 2)})
        # the same without a catalog: the markers name run 'train', not an inference job's
        plain = CheckpointingConfig(save_dir=run_dir)
        with CheckpointManager(plain, kind="inference") as reader:
            assert reader.load_latest({"model": nn.Linear(3, 2)}).step is None
        # the DCP drop-in reader, latest and by step
        with zd.Reader(run_dir, catalog=catalog_url, subdir="dcp") as dcp_reader:
            target = {"model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}}
            target = {f"model/{k}": v for k, v in target["model"].items()}
            zd.load(target, dcp_reader, allow_partial_load=True)
        export_safetensors(CheckpointStore(save_dir), RUN, 8, str(tmp_path / "exported"))
        for argv in (["verify", RUN, "--deep"], ["latest", RUN], ["checkpoints", RUN]):
            assert zephon_main([argv[0], "--catalog", catalog_url, *argv[1:]]) == 0
        capsys.readouterr()

        assert _footprint(save_dir, catalog) == before
        assert not [n for _, _, names in os.walk(run_dir) for n in names if "_CORRUPT" in n]
        assert zephon_main(["gc", "--catalog", catalog_url, "--grace", "0"]) == 0
        assert "deleted" not in capsys.readouterr().out
        assert [m.step for m in CheckpointStore(save_dir).run(RUN).complete()] == [4, 8, 12]
        assert _footprint(save_dir, catalog) == before


def test_an_inference_job_registers_its_attempt_at_its_first_save_resuming_from_its_load(
    tmp_path,
):
    save_dir = str(tmp_path / "infer")
    config = CheckpointingConfig(save_dir=save_dir, period_steps=1)
    model = nn.Linear(3, 2)
    with CheckpointManager(config, kind="inference") as job:
        job.load_latest({"model": model})
        job.save(3, {"model": model})
    with CheckpointManager(config, kind="inference") as job:
        assert job.load_latest({"model": model}).step == 3
        assert job.attempt is None  # loading alone registers nothing
        job.save(4, {"model": model})
        assert job.attempt.resumed_from == 3 and not job.attempt.implicit
    assert CheckpointStore(save_dir).run(None).lineage().current.resumed_from == 3


def test_a_save_below_the_latest_is_refused_at_the_first_save_unless_the_resume_step_is_declared(
    tmp_path,
):
    save_dir = str(tmp_path / "ckpt")
    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    _train(save_dir, catalog_url)
    url = f"{save_dir}/{RUN}"
    state = {"w": torch.ones(2)}
    with Catalog(catalog_url) as catalog:
        rows_before = sorted((r.step, r.state) for r in catalog.list_checkpoints(RUN))

        # the drop-in Writer of a job that started over without saying so
        writer = zd.Writer(url, catalog=catalog_url)
        with writer, pytest.raises(SaveBelowLatestError) as info:
            zd.save(state, writer, checkpoint_id=f"{url}/save-4")
        message = str(info.value)
        assert "\n" not in message
        assert all(
            w in message for w in ("step 4", "latest checkpoint 12", "LATEST", "resume_step")
        )
        assert (info.value.step, info.value.latest) == (4, 12)
        # the manager's save without load_latest: the same refusal, from the same place
        config = CheckpointingConfig(save_dir=save_dir, catalog_url=catalog_url)
        manager = CheckpointManager(config, run_name=RUN, total_steps=100)
        below = "step 8 below its latest checkpoint 12"
        with manager, pytest.raises(SaveBelowLatestError, match=below):
            manager.save(8, {"model": nn.Linear(3, 2)})
        assert sorted((r.step, r.state) for r in catalog.list_checkpoints(RUN)) == rows_before
        assert sorted(os.listdir(f"{save_dir}/{RUN}/save-4")) == ["_COMMIT", *_payload(url, 4)]

        # above the latest is fine without declaring anything
        with zd.Writer(url, catalog=catalog_url) as writer:
            zd.save(state, writer, checkpoint_id=f"{url}/save-16")
        # declared: resume_step=8 abandons 12 and 16; the job saves 9 and becomes the latest
        with zd.Writer(url, catalog=catalog_url, resume_step=8) as writer:
            zd.save(state, writer, checkpoint_id=f"{url}/save-9")
            assert writer.attempt.resumed_from == 8
        rows = {r.step: r.state for r in catalog.list_checkpoints(RUN)}
        assert rows[9] == "committed" and rows[12] == rows[16] == "stale"
    with pytest.raises(ConfigError, match="resume_step = -1"):
        zd.Writer(url, resume_step=-1)


def _payload(url: str, step: int) -> list[str]:
    """The one save directory of checkpoint ``step`` (its ``e<epoch>-...`` payload)."""
    return [n for n in os.listdir(f"{url}/save-{step}") if n.startswith("e")]


@pytest.mark.parametrize("how", ["same", "symlink", "file"])
def test_a_local_dir_that_is_save_dir_or_a_file_is_refused_at_configuration(tmp_path, how):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    local = {"same": save_dir, "symlink": tmp_path / "link", "file": tmp_path / "a-file"}[how]
    if how == "symlink":
        local.symlink_to(save_dir)
    elif how == "file":
        local.write_text("not a directory")
    expected = "names a file" if how == "file" else "it is save_dir"
    for make in (
        lambda: CheckpointingConfig(save_dir=str(save_dir), local_dir=str(local)),
        lambda: CheckpointingConfig(save_dir=f"file://{save_dir}", local_dir=str(local)),
        lambda: zd.Writer(f"{save_dir}/run", local_dir=str(local)),
    ):
        with pytest.raises(ConfigError, match="local_dir") as info:
            make()
        assert expected in str(info.value) and "\n" not in str(info.value)
    CheckpointingConfig(save_dir=str(save_dir), local_dir=str(tmp_path / "local"))


def test_folder_checkpoints_register_at_their_first_save_and_refuse_a_save_below_the_latest(
    tmp_path,
):
    from zephon.integrations.accelerate import FolderCheckpoints, fetch_latest

    save_dir = str(tmp_path / "ckpt")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w")

    def job(**kwargs) -> FolderCheckpoints:
        checkpoints = FolderCheckpoints(save_dir, RUN, **kwargs)
        checkpoints.start()
        return checkpoints

    first = job()
    for step in (4, 8):
        first.save_folder(str(folder), step)
    first.close()
    attempts = _attempts_on_storage(save_dir)
    assert fetch_latest(save_dir, RUN, local_dir=str(tmp_path / "dl"))[0] == 8
    loaded = job()  # a job that loads through Zephon and stops before saving
    loaded.start(resumed_from=8)
    loaded.close()
    assert _attempts_on_storage(save_dir) == attempts

    fresh = job()  # the Trainer resumed from nothing: not declared
    with pytest.raises(SaveBelowLatestError, match="step 2 below its latest checkpoint 8"):
        fresh.save_folder(str(folder), 2)
    fresh.close()
    over = job(resume_step=0)  # declared: the run starts over
    over.save_folder(str(folder), 2)
    over.close()
    store = CheckpointStore(save_dir)
    assert store.run(RUN).lineage().current.resumed_from == 0 and store.run(RUN).latest().step == 2


def _attempts_on_storage(save_dir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(save_dir, RUN, "_attempts")))
