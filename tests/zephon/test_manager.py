"""The checkpoint manager's seed-002 rules, in one process (the multi-process runs are in
test_manager_distributed.py)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from torch import nn

from tests.zephon.saves import flip_a_tensor_byte
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager, export_safetensors
from zephon.config import CheckpointingConfig, ModelStageConfig, load_job_config
from zephon.errors import ConfigError, ZephonError
from zephon.storage import CorruptCheckpointError


def build(seed: int = 0, total_steps: int = 10):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    warmup = max(1, total_steps // 5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / total_steps)
    )
    return model, optimizer, scheduler


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def train(manager, model, optimizer, scheduler, counter, start, stop, losses=None):
    data = torch.Generator().manual_seed(99)
    xs = [torch.randn(5, 4, generator=data) for _ in range(stop + 1)]
    for step in range(start, stop + 1):
        optimizer.zero_grad()
        loss = model(xs[step]).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        counter.value += 1
        if losses is not None:
            losses[step] = (loss.item(), scheduler.get_last_lr()[0])
        state = {
            "model": model,
            "optimizer": optimizer,
            "lr_scheduler": scheduler,
            "task": counter,
            "notes": {"step": step, "tuple": (1, 2.5)},
        }
        manager.maybe_save(step, state)


def state_of(model, optimizer, scheduler, counter, notes=None):
    return {
        "model": model,
        "optimizer": optimizer,
        "lr_scheduler": scheduler,
        "task": counter,
        "notes": notes,
    }


@pytest.fixture
def config(tmp_path) -> CheckpointingConfig:
    return CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        period_steps=3,
        num_to_keep=2,
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
    )


def manager_for(config, total_steps=10, **kwargs):
    return CheckpointManager(
        config, run_name=kwargs.pop("run_name", "r"), total_steps=total_steps, **kwargs
    )


# -- when ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("period", "expected"),
    [(3, [3, 6, 9, 10]), (5, [5, 10]), ("last_step", [10]), ("disable", [])],
)
def test_saves_every_period_and_at_the_last_step(config, period, expected):
    config.period_steps = period
    config.num_to_keep = None
    with manager_for(config) as manager:
        assert [s for s in range(1, 11) if manager.should_save(s)] == expected
        train(manager, *build(), Counter(), 1, 10)
        assert manager.store.run("r").committed_steps() == expected


def test_after_each_save_only_num_to_keep_remain(config):
    with manager_for(config) as manager:
        model, optimizer, scheduler = build()
        counter = Counter()
        train(manager, model, optimizer, scheduler, counter, 1, 7)
        assert manager.store.run("r").committed_steps() == [3, 6]
        train(manager, model, optimizer, scheduler, counter, 8, 10)
        assert manager.store.run("r").committed_steps() == [9, 10]
    with Catalog(config.catalog_url) as catalog:
        states = {r.step: r.state for r in catalog.list_checkpoints("r")}
        assert states == {3: "deleted", 6: "deleted", 9: "committed", 10: "committed"}
        run = catalog.get_run("r")
        assert (run.num_to_keep, run.total_steps, run.status) == (2, 10, "active")


def test_without_a_catalog_retention_uses_the_storage_scan(tmp_path, monkeypatch):
    monkeypatch.delenv("ZEPHON_CATALOG_URL", raising=False)
    config = CheckpointingConfig(save_dir=str(tmp_path / "ckpt"), period_steps=2, num_to_keep=1)
    with manager_for(config) as manager:
        assert manager.catalog is None
        train(manager, *build(), Counter(), 1, 10)
        assert manager.store.run("r").committed_steps() == [10]


def test_num_to_keep_null_keeps_all(config):
    config.num_to_keep = None
    with manager_for(config) as manager:
        train(manager, *build(), Counter(), 1, 10)
        assert manager.store.run("r").committed_steps() == [3, 6, 9, 10]


# -- resume ----------------------------------------------------------------------------------


def test_a_fresh_start_begins_at_step_1(config):
    with manager_for(config) as manager:
        resume = manager.load_latest(state_of(*build(), Counter()))
    assert (resume.step, resume.next_step, resume.finished, resume.resumed) == (
        None,
        1,
        False,
        False,
    )


def test_an_interrupted_job_continues_from_the_step_after_its_latest(config):
    reference = {}
    with manager_for(config, run_name="ref") as manager:
        model_ref, opt_ref, sched_ref = build()
        train(manager, model_ref, opt_ref, sched_ref, Counter(), 1, 10, reference)

    with manager_for(config) as manager:
        train(manager, *build(), Counter(), 1, 7)  # "crashes" after step 7; latest is 6
    model, optimizer, scheduler = build(seed=1)  # a new process: other initial weights
    counter = Counter()
    losses = {}
    with manager_for(config) as manager:
        resume = manager.load_latest(state_of(model, optimizer, scheduler, counter))
        assert (resume.step, resume.next_step) == (6, 7)
        assert resume.values == {"notes": {"step": 6, "tuple": (1, 2.5)}}
        assert counter.value == 6
        train(manager, model, optimizer, scheduler, counter, resume.next_step, 10, losses)
    assert losses == {s: reference[s] for s in range(7, 11)}
    for a, b in zip(model.parameters(), model_ref.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        optimizer.state_dict()["state"][0]["exp_avg"], opt_ref.state_dict()["state"][0]["exp_avg"]
    )


def test_a_finished_job_logs_and_stops(config, caplog):
    with manager_for(config) as manager:
        train(manager, *build(), Counter(), 1, 10)
        manager.finish()
    with Catalog(config.catalog_url) as catalog:
        assert catalog.get_run("r").status == "finished"
    with caplog.at_level(logging.INFO, logger="zephon"), manager_for(config) as manager:
        resume = manager.load_latest(state_of(*build(), Counter()))
    assert resume.finished and resume.step == 10
    assert "Training is already complete, nothing to do" in caplog.messages


def test_a_finished_inference_job_logs_its_own_message(tmp_path, caplog):
    config = CheckpointingConfig(save_dir=str(tmp_path / "infer-job"), period_steps=2)
    with CheckpointManager(config, total_steps=4, kind="inference") as manager:
        assert manager.name == "infer-job"
        for step in range(1, 5):
            manager.maybe_save(step, {"done": {"step": step}})
        assert manager.store.run(None).committed_steps() == [2, 4]
        assert os.path.isdir(tmp_path / "infer-job" / "save-4")
    with (
        caplog.at_level(logging.INFO, logger="zephon"),
        CheckpointManager(config, total_steps=4, kind="inference") as manager,
    ):
        assert manager.load_latest({"done": None}).finished
    assert "Inference is already complete, nothing to do" in caplog.messages


def test_raising_total_steps_continues_to_the_new_last_step_on_the_new_schedule(config):
    with manager_for(config, total_steps=6) as manager:
        model, optimizer, scheduler = build(total_steps=6)
        train(manager, model, optimizer, scheduler, Counter(), 1, 6)
    # the same job with total_steps raised to 12, its LR schedule built for 12 steps
    model, optimizer, scheduler = build(total_steps=12)
    fresh_schedule = build(total_steps=12)[2]
    losses = {}
    with manager_for(config, total_steps=12) as manager:
        resume = manager.load_latest(state_of(model, optimizer, scheduler, Counter()))
        assert (resume.step, resume.next_step, resume.finished) == (6, 7, False)
        assert resume.saved_total_steps == 6
        train(manager, model, optimizer, scheduler, Counter(), 7, 12, losses)
        assert manager.store.run("r").committed_steps() == [9, 12]
    for _ in range(12):
        fresh_schedule.optimizer.step()
        fresh_schedule.step()
    # after step 12 the resumed scheduler is where a 12-step schedule is, not a 6-step one
    assert losses[12][1] == fresh_schedule.get_last_lr()[0]


def test_load_names_missing_and_unexpected_keys(config):
    with manager_for(config) as manager:
        train(manager, *build(), Counter(), 1, 3)
    torch.manual_seed(0)
    bigger = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 3))
    with manager_for(config) as manager, pytest.raises(ZephonError, match=r"model/3\.weight"):
        manager.load_latest({"model": bigger})
    smaller = nn.Sequential(nn.Linear(4, 8))
    with manager_for(config) as manager, pytest.raises(ZephonError, match=r"model/2\.weight"):
        manager.load_latest({"model": smaller})
    wrong = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 3))
    with manager_for(config) as manager, pytest.raises(ZephonError, match=r"0\.weight.*\[8, 4\]"):
        manager.load_latest({"model": wrong})
    with manager_for(config) as manager, pytest.raises(ZephonError, match="holds no 'other'"):
        manager.load_latest({"model": build()[0], "other": Counter()})


def flip_a_byte(store, step: int) -> str:
    """Flip one byte of a tensor in a shard of checkpoint ``step``; returns the shard."""
    return flip_a_tensor_byte(store.run("r").reader(step).path)


def test_with_on_corrupt_fail_a_damaged_checkpoint_is_refused_naming_the_file(config):
    with manager_for(config) as manager:
        train(manager, *build(), Counter(), 1, 3)
        shard = flip_a_byte(manager.store, 3)
    config.on_corrupt = "fail"
    with manager_for(config) as manager, pytest.raises(CorruptCheckpointError, match=shard):
        manager.load_latest(state_of(*build(), Counter()))


def test_a_damaged_checkpoint_is_quarantined_and_the_previous_one_loaded(config, caplog):
    with manager_for(config) as manager:
        model, optimizer, scheduler = build()
        train(manager, model, optimizer, scheduler, Counter(), 1, 6)
        flip_a_byte(manager.store, 6)
    with manager_for(config) as manager:
        resume = manager.load_latest(state_of(*build(), Counter()))
        assert resume.step == 3
        assert manager.catalog.get_checkpoint("r", 6).state == "corrupt"
        assert manager.store.run("r").condemned() == [
            (6, manager.store.run("r").read_manifest(6).save_id)
        ]
    assert any("save-6 failed verification" in r.getMessage() for r in caplog.records)


def test_non_tensor_state_is_json_and_nothing_is_pickled(config):
    with manager_for(config) as manager:
        train(manager, *build(), Counter(), 1, 3)
        reader = manager.store.run("r").reader(3)
        for name in reader.names:
            data = reader.read_bytes(name)
            if name.endswith(".json"):
                json.loads(data)
            if name.endswith("/.metadata"):
                continue  # torch's own pickled metadata, for its stock readers; never read here
            if name.endswith(".distcp"):
                assert data.startswith(b"PK"), name  # tensors as torch.save blobs: raw bytes read
                continue
            assert b"\x80\x04\x95" not in data[:64] and not data.startswith(b"PK"), name
    with manager_for(config) as manager, pytest.raises(ZephonError, match="never with pickle"):
        manager.save(4, {"model": build()[0], "bad": object()})


# -- async -------------------------------------------------------------------------------------


def test_async_save_stages_a_copy_and_commits_in_the_background(config):
    config.async_save = True
    model, optimizer, scheduler = build()
    with manager_for(config) as manager:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        manager.save(3, {"model": model})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # training goes on while the save is written
        manager.wait()
        assert manager.store.run("r").committed_steps() == [3]
    fresh = build(seed=5)[0]
    with manager_for(config) as manager:
        manager.load_latest({"model": fresh})
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_a_failed_background_save_is_raised_by_the_next_call(config, monkeypatch):
    config.async_save = True
    model = build()[0]
    with manager_for(config) as manager:
        from zephon.storage import writer as writer_module

        real = writer_module.CheckpointWriter.commit

        def broken(self, *args, **kwargs):
            raise OSError("disk full while committing")

        # Fault injection: the background commit of step 3 fails as a full disk would.
        monkeypatch.setattr(writer_module.CheckpointWriter, "commit", broken)
        manager.save(3, {"model": model})  # returns once staged
        with pytest.raises(Exception, match="disk full while committing"):
            manager.save(6, {"model": model})  # raises the background failure, saves nothing
        monkeypatch.setattr(writer_module.CheckpointWriter, "commit", real)
        assert manager.store.run("r").list_steps() == []  # the failed attempt left nothing behind
        manager.save(6, {"model": model})
        manager.wait()
        assert manager.store.run("r").committed_steps() == [6]
    with Catalog(config.catalog_url) as catalog:
        assert catalog.get_checkpoint("r", 3).state == "failed"


# -- trainable only, export --------------------------------------------------------------------


def test_only_trainable_parameters_are_saved_and_frozen_come_from_the_source(config, tmp_path):
    base, _, _ = build()
    export_dir = str(tmp_path / "base-export")
    with manager_for(config, run_name="base") as manager:
        manager.save(1, {"model": base})
        export_safetensors(manager.store, "base", 1, export_dir)

    def adapter_model(seed):
        model, _, _ = build(seed)
        model[0].requires_grad_(False)  # frozen base layer
        return model

    stage = ModelStageConfig(
        checkpoint_only_trainable_parameters=True, source_checkpoint=export_dir
    )
    tuned = adapter_model(0)
    with torch.no_grad():
        tuned[2].weight.add_(3.0)
    with manager_for(config, run_name="lora", model_stage=stage) as manager:
        manager.save(2, {"model": tuned})
        names = manager.store.run("lora").reader(2).names
        meta = json.loads(manager.store.run("lora").reader(2).read_bytes("zephon.json"))
        assert set(meta["state"]["model"]) == {"2.weight", "2.bias"}
    resumed = adapter_model(7)  # other weights everywhere until loaded
    with manager_for(config, run_name="lora", model_stage=stage) as manager:
        assert manager.load_latest({"model": resumed}).step == 2
    for name, tensor in tuned.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name
    assert any(n.startswith("dcp/") for n in names)


def test_trainable_only_without_a_source_is_a_config_error():
    with pytest.raises(ConfigError, match="source_checkpoint is not set"):
        ModelStageConfig(checkpoint_only_trainable_parameters=True)


def test_export_writes_sharded_safetensors_equal_to_the_live_model(config, tmp_path):
    from safetensors.torch import load_file

    model, _, _ = build()
    with manager_for(config) as manager:
        manager.save(3, {"model": model})
        result = export_safetensors(
            manager.store, "r", 3, str(tmp_path / "out"), max_shard_bytes=100
        )
    assert len(result.files) > 2 and result.files[-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == result.total_bytes
    loaded = {}
    for file_name in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(str(tmp_path / "out" / file_name)))
    assert loaded.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor)


# -- config ------------------------------------------------------------------------------------


def test_the_seed_yaml_shape_loads(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "run: {name: my-run}\n"
        "trainer:\n  total_steps: 1000\n  checkpointing:\n    save_dir: runs/checkpoints\n"
        "    period_steps: 100\n    num_to_keep: 2\n"
        "model_stage_factory:\n  checkpoint_only_trainable_parameters: false\n  hidden: 4\n"
    )
    job = load_job_config(path)
    assert (job.run_name, job.total_steps) == ("my-run", 1000)
    assert (job.checkpointing.period_steps, job.checkpointing.num_to_keep) == (100, 2)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"period_steps": 0},
            r"trainer\.checkpointing\.period_steps = 0 is invalid: use an "
            r"integer from 1 to 9223372036854775807, \"last_step\", \"disable\" or \"auto\"",
        ),
        ({"period_steps": "weekly"}, r"period_steps = 'weekly'"),
        (
            {"num_to_keep": 0},
            r"num_to_keep = 0 is invalid: use an integer from 1 to 2147483647, or null",
        ),
        ({"num_to_keep": True}, r"num_to_keep = True"),
        ({"save_dir": ""}, r"save_dir = '' is invalid"),
        ({"catalog_url": "db.sqlite"}, r"catalog_url = 'db.sqlite' is invalid"),
        ({"async_save": "yes"}, r"async_save = 'yes' is invalid: use true or false"),
        ({"colour": "red"}, r"trainer\.checkpointing\.colour is not a known setting"),
    ],
)
def test_invalid_config_values_name_the_key_value_and_what_is_allowed(section, message):
    tree = {"run": {"name": "r"}, "trainer": {"checkpointing": {"save_dir": "x", **section}}}
    with pytest.raises(ConfigError, match=message):
        load_job_config(tree)


def test_invalid_run_name_and_total_steps_are_named():
    with pytest.raises(ConfigError, match=r"run\.name = 'a/b'"):
        load_job_config({"run": {"name": "a/b"}, "trainer": {"checkpointing": {"save_dir": "x"}}})
    with pytest.raises(ConfigError, match=r"trainer\.total_steps = -1"):
        load_job_config({"trainer": {"total_steps": -1, "checkpointing": {"save_dir": "x"}}})
