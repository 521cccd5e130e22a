"""What Zephon raises: everything on purpose is one of three roots (``zephon.ZephonError``,
``zephon.StorageError``, ``zephon.CatalogError``) with a one-line message, and a checkpoint
that is not there is ``zephon.CheckpointNotFoundError`` wherever it is asked for: through the
manager, the DCP Reader and the CLI."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import zephon
from tests.zephon.saves import flip_a_tensor_byte
from zephon import dcp as zdcp
from zephon.catalog import CheckpointRecordNotFoundError
from zephon.checkpointing import CheckpointManager
from zephon.cli import EXIT_STORAGE
from zephon.config import CheckpointingConfig, ModelStageConfig
from zephon.storage import CorruptCheckpointError

ROOTS = (zephon.ZephonError, zephon.StorageError, zephon.CatalogError)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the installed ``zephon`` command
ZEPHON = os.path.join(os.path.dirname(sys.executable), "zephon")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def config_at(tmp_path, **overrides) -> CheckpointingConfig:
    values = {
        "save_dir": str(tmp_path / "ckpt"),
        "period_steps": 1,
        "num_to_keep": 3,
        "catalog_url": f"sqlite:///{tmp_path / 'catalog.db'}",
        **overrides,
    }
    return CheckpointingConfig(**values)


def saved(tmp_path, **overrides) -> CheckpointingConfig:
    """A run ``r`` with checkpoint 1 committed (catalog and storage)."""
    config = config_at(tmp_path, **overrides)
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        manager.save(1, {"model": model(), "notes": {"epoch": 1}})
    return config


def load(config: CheckpointingConfig, state=None, **kwargs):
    """A new job's ``load_latest`` (construction included: some failures are met there)."""
    with CheckpointManager(config, run_name="r", total_steps=10, **kwargs) as manager:
        return manager.load_latest(state if state is not None else {"model": model()})


def assert_one_root_one_line(exc: BaseException) -> None:
    assert isinstance(exc, ROOTS), f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    message = str(exc)
    assert message and "\n" not in message, message


# -- load_latest: every failure is a root, in one line ------------------------------------------


def a_shard(config: CheckpointingConfig) -> str:
    """One DCP shard file of checkpoint 1 (the largest: it holds tensor bytes)."""
    shards = glob.glob(os.path.join(config.save_dir, "r", "save-1", "*", "dcp", "*.distcp"))
    return max(sorted(shards), key=os.path.getsize)


def damage_a_shard(config: CheckpointingConfig) -> None:
    flip_a_tensor_byte(os.path.dirname(os.path.dirname(a_shard(config))))


def remove_a_shard(config: CheckpointingConfig) -> None:
    os.remove(a_shard(config))


def test_a_damaged_checkpoint_with_on_corrupt_fail_is_a_storage_error_in_one_line(tmp_path):
    config = saved(tmp_path, on_corrupt="fail")
    damage_a_shard(config)
    with pytest.raises(CorruptCheckpointError) as caught:
        load(config)
    assert_one_root_one_line(caught.value)
    assert "save-1" in str(caught.value)


def test_a_shard_gone_with_on_corrupt_fail_is_a_storage_error_in_one_line(tmp_path):
    config = saved(tmp_path, on_corrupt="fail")
    remove_a_shard(config)
    with pytest.raises(zephon.StorageError) as caught:
        load(config)
    assert_one_root_one_line(caught.value)
    assert "missing" in str(caught.value)


def test_a_state_that_does_not_fit_is_a_zephon_error_in_one_line(tmp_path):
    config = saved(tmp_path)
    with pytest.raises(zephon.ZephonError) as caught:
        load(config, {"model": model(), "notes": nn.Linear(1, 1)})
    assert_one_root_one_line(caught.value)


def test_a_checkpoint_the_catalog_has_no_row_for_is_recorded_by_the_next_start(tmp_path):
    """A marker the catalog has no row of above its newest committed one (a job that ended
    during a catalog outage) is recorded by the next job start, by the one rule, and resumed
    from: never abandoned for an older checkpoint (docs/catalog.md, "When the catalog is
    down")."""
    import sqlite3

    config = saved(tmp_path)
    with sqlite3.connect(tmp_path / "catalog.db") as db:
        db.execute("DELETE FROM checkpoint_replicas")
        db.execute("DELETE FROM checkpoints")
    assert load(config).step == 1
    assert os.path.exists(os.path.join(config.save_dir, "r", "save-1", "_COMMIT"))


@pytest.mark.parametrize(
    ("save_dir", "storage_options", "error"),
    [
        pytest.param(
            "s3://no-bucket/ckpt",
            {
                "key": "k",
                "secret": "s",
                "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
                "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
            },
            zephon.StorageError,
            id="storage-down",
        ),
        pytest.param("nope://c/ckpt", {}, zephon.StorageError, id="unknown-protocol"),
    ],
)
def test_storage_that_cannot_be_used_is_a_storage_error_in_one_line(
    tmp_path, save_dir, storage_options, error
):
    config = config_at(
        tmp_path,
        save_dir=save_dir,
        storage_options=storage_options,
        catalog_url=None,
        retry={"max_attempts": 1},  # the endpoint is dead on purpose
    )
    with pytest.raises(error) as caught:
        load(config)
    assert_one_root_one_line(caught.value)


def test_a_catalog_that_does_not_answer_past_catalog_outage_s_is_one_line(tmp_path):
    config = config_at(
        tmp_path, catalog_url="postgresql://postgres@127.0.0.1:9/zephon", catalog_outage_s=1
    )
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        assert load(config).step is None  # a job starts from storage while the catalog is away
        time.sleep(1.1)
        with pytest.raises(zephon.CatalogOutageError) as caught:
            manager.save(1, {"model": model()})
    assert_one_root_one_line(caught.value)


@pytest.mark.parametrize(
    ("state", "rank_state", "message"),
    [
        ({"model": None, "notes": {"when": object()}}, None, "never with pickle"),
        ({"notes": {"a": 1}}, {"t": torch.zeros(1)}, "rank_state holds tensors"),
        ({"sparse": torch.zeros(2, 2).to_sparse()}, None, "Zephon writes dense tensors"),
    ],
    ids=["not-json", "rank-state-tensor", "sparse-tensor"],
)
def test_a_state_save_cannot_hold_is_a_zephon_error_in_one_line_and_nothing_is_left(
    tmp_path, state, rank_state, message
):
    config = config_at(tmp_path)
    state = {k: (model() if v is None else v) for k, v in state.items()}
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        with pytest.raises(zephon.ZephonError, match=message) as caught:
            manager.save(1, state, rank_state=rank_state)
        assert manager.store.run("r").committed_steps() == []
    assert_one_root_one_line(caught.value)


# -- a checkpoint that is not there: the one CheckpointNotFoundError ---------------------------


def test_there_is_one_checkpoint_not_found_error_and_it_is_storages():
    from zephon import storage

    assert zephon.CheckpointNotFoundError is storage.CheckpointNotFoundError
    assert issubclass(zephon.CheckpointNotFoundError, zephon.StorageError)
    assert "CheckpointNotFoundError" in zephon.__all__
    assert not issubclass(CheckpointRecordNotFoundError, zephon.CheckpointNotFoundError)


def test_an_absent_source_checkpoint_through_the_manager_is_checkpoint_not_found(tmp_path):
    """A trainable-only checkpoint whose source step is not there: the source's absence is
    raised as it is, and the job's own checkpoint is not taken for damaged (not quarantined)."""
    absent = f"{tmp_path / 'ckpt'}/base/save-99"
    stage = ModelStageConfig(checkpoint_only_trainable_parameters=True, source_checkpoint=absent)
    config = config_at(tmp_path)
    with CheckpointManager(config, run_name="r", total_steps=10, model_stage=stage) as manager:
        manager.save(1, {"model": model()})
    with pytest.raises(zephon.CheckpointNotFoundError) as caught:
        load(config, model_stage=stage)
    assert_one_root_one_line(caught.value)
    assert absent in str(caught.value) and "source_checkpoint" in str(caught.value)
    assert isinstance(caught.value.__cause__, zephon.CheckpointNotFoundError)
    with CheckpointManager(config, run_name="r", total_steps=10) as manager:
        assert manager.catalog.get_checkpoint("r", 1).state == "committed"


def test_an_absent_step_through_the_dcp_reader_is_checkpoint_not_found(tmp_path):
    config = saved(tmp_path)
    reader = zdcp.Reader(f"{config.save_dir}/r", step=99)
    with pytest.raises(zephon.CheckpointNotFoundError) as caught:
        zdcp.load({"0.weight": torch.zeros(4, 3)}, reader)
    assert_one_root_one_line(caught.value)
    assert "save-99" in str(caught.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "r", "--step", "99"],
        ["export", "r", "--step", "99", "--out", "{tmp}/out"],
        ["pin", "r", "99"],
        ["unpin", "r", "99"],
    ],
    ids=lambda argv: argv[0],
)
def test_an_absent_step_through_the_cli_is_checkpoint_not_found_exit_4_in_one_line(tmp_path, argv):
    saved(tmp_path)
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    args = [a.format(tmp=tmp_path) for a in argv]
    done = subprocess.run(
        [ZEPHON, args[0], "--catalog", catalog, *args[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert done.returncode == EXIT_STORAGE, done.stderr
    assert done.stderr.startswith("zephon: error: ") and done.stderr.count("\n") == 1
    assert "99" in done.stderr and "zephon checkpoints r" in done.stderr


def test_pin_of_an_absent_step_raises_the_one_error_caused_by_the_catalogs(tmp_path):
    from zephon.cli import build_parser
    from zephon.cli.commands import cmd_pin

    saved(tmp_path)
    args = build_parser().parse_args(
        ["pin", "--catalog", f"sqlite:///{tmp_path / 'catalog.db'}", "r", "99"]
    )
    with pytest.raises(zephon.CheckpointNotFoundError) as caught:
        cmd_pin(args)
    assert isinstance(caught.value.__cause__, CheckpointRecordNotFoundError)
    assert (caught.value.run, caught.value.step) == ("r", 99)


def test_json_output_is_untouched_by_the_error_path(tmp_path, capsys):
    """``pin --json`` of a present step still prints the row (the error path wraps only the
    missing one)."""
    from zephon.cli import main

    saved(tmp_path)
    code = main(["pin", "--catalog", f"sqlite:///{tmp_path / 'catalog.db'}", "--json", "r", "1"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["pinned"] is True
