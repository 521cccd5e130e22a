"""Every retention option through every saving entry point (issue 20): the checkpoint manager
(its config keys), ``zephon.dcp.Writer``, accelerate's ``AcceleratorCheckpoints``, the Hugging
Face ``ZephonCallback`` and Lightning's ``ZephonCheckpointIO`` each take ``num_to_keep`` and
``keep_every_steps``, a catalog from the argument or from ``$ZEPHON_CATALOG_URL``, and (all but
the manager, which resumes through ``load_latest``) ``resume_step``; a wrong value gets the
one message of ``zephon.retention``, naming the entry point. torchtitan's checkpointer runs in
its own environment: its case is in tests/zephon/integrations/test_torchtitan.py.

Real saves of tiny states on local disk, with a SQLite catalog, in this process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from zephon.catalog import Catalog
from zephon.errors import ConfigError, SaveBelowLatestError
from zephon.locations import CATALOG_URL_ENV
from zephon.retention import MAX_KEEP, Retention, check_resume_step
from zephon.session import resolve_catalog
from zephon.storage import CheckpointStore

RUN = "entry"
#: steps 1..6 saved with num_to_keep=2, keep_every_steps=3 keep the newest two and step 3
BOTH = {"num_to_keep": 2, "keep_every_steps": 3}
KEPT_WITH_BOTH = [3, 5, 6]


@dataclass
class Job:
    """One job of an entry point: ``save(step)`` commits checkpoint ``step``; ``close``."""

    save: Callable[[int], None]
    close: Callable[[], None]


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2,), float(step))}


def manager_job(tmp_path, save_dir: str, catalog: str | None, **options: Any) -> Job:
    from zephon import CheckpointingConfig, CheckpointManager

    config = CheckpointingConfig(save_dir=save_dir, catalog_url=catalog, **options)
    manager = CheckpointManager(config, run_name=RUN, save_rng=False)
    return Job(lambda step: manager.save(step, _state(step)), manager.close)


def writer_job(tmp_path, save_dir: str, catalog: str | None, **options: Any) -> Job:
    import zephon.dcp as zd

    url = f"{save_dir}/{RUN}"
    writer = zd.Writer(url, catalog=catalog, **options)

    def save(step: int) -> None:
        zd.save(_state(step), writer, checkpoint_id=f"{url}/save-{step}")

    return Job(save, writer.close)


def accelerate_job(tmp_path, save_dir: str, catalog: str | None, **options: Any) -> Job:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from zephon.integrations.accelerate import AcceleratorCheckpoints

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 1))
    checkpoints = AcceleratorCheckpoints(
        accelerator, save_dir, RUN, catalog=catalog, local_dir=str(tmp_path / "acc"), **options
    )
    return Job(checkpoints.save_state, checkpoints.close)


def huggingface_job(tmp_path, save_dir: str, catalog: str | None, **options: Any) -> Job:
    """The callback driven as the Trainer drives it: ``on_train_begin``, then ``on_save``
    after each ``checkpoint-N`` folder is written (a Trainer itself would only add seconds)."""
    pytest.importorskip("transformers")
    from zephon.integrations.huggingface import ZephonCallback

    callback = ZephonCallback(save_dir, RUN, catalog=catalog, **options)
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), run_name=None)
    state = SimpleNamespace(global_step=0)
    callback.on_train_begin(args, state, None)

    def save(step: int) -> None:
        folder = tmp_path / "out" / f"checkpoint-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"weights of step %d" % step)
        state.global_step = step
        callback.on_save(args, state, None)

    return Job(save, lambda: callback.on_train_end(args, state, None))


def lightning_job(tmp_path, save_dir: str, catalog: str | None, **options: Any) -> Job:
    pytest.importorskip("lightning")
    from zephon.integrations.lightning import ZephonCheckpointIO

    io = ZephonCheckpointIO(save_dir, RUN, catalog=catalog, **options)

    def save(step: int) -> None:
        checkpoint = {"global_step": step, "epoch": 0, "state_dict": _state(step)}
        io.save_checkpoint(checkpoint, f"epoch=0-step={step}.ckpt")

    return Job(save, io.close)


@dataclass(frozen=True)
class EntryPoint:
    name: str
    #: how its messages name its options: an argument's owner, or a config prefix
    owner: str
    open: Callable[..., Job]
    takes_resume_step: bool = True


ENTRY_POINTS = [
    EntryPoint("manager", "trainer.checkpointing.", manager_job, takes_resume_step=False),
    EntryPoint("dcp-writer", "Writer", writer_job),
    EntryPoint("accelerate", "AcceleratorCheckpoints", accelerate_job),
    EntryPoint("huggingface", "ZephonCallback", huggingface_job),
    EntryPoint("lightning", "ZephonCheckpointIO", lightning_job),
]
RESUMING = [entry for entry in ENTRY_POINTS if entry.takes_resume_step]


def _ids(entries: list[EntryPoint]) -> list[str]:
    return [entry.name for entry in entries]


@pytest.fixture(autouse=True)
def no_catalog_from_the_environment(monkeypatch):
    """A case sets ``$ZEPHON_CATALOG_URL`` only when it tests it."""
    monkeypatch.delenv(CATALOG_URL_ENV, raising=False)


def _save_steps(entry: EntryPoint, tmp_path, steps, catalog: str | None = None, **options):
    job = entry.open(tmp_path, str(tmp_path / "ckpt"), catalog, **options)
    try:
        for step in steps:
            job.save(step)
    finally:
        job.close()


def _stored(tmp_path) -> list[int]:
    return [m.step for m in CheckpointStore(str(tmp_path / "ckpt")).run(RUN).complete()]


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        ({"num_to_keep": 2}, [5, 6]),
        ({"keep_every_steps": 3}, [1, 2, 3, 4, 5, 6]),  # milestones alone delete nothing
        (BOTH, KEPT_WITH_BOTH),
    ],
    ids=["num_to_keep", "keep_every_steps", "both"],
)
@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=_ids(ENTRY_POINTS))
def test_retention_without_a_catalog_keeps_the_newest_and_the_milestones(
    entry, options, kept, tmp_path
):
    _save_steps(entry, tmp_path, range(1, 7), **options)
    assert _stored(tmp_path) == kept


@pytest.mark.parametrize("given", ["argument", "environment"])
@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=_ids(ENTRY_POINTS))
def test_the_catalog_from_the_argument_or_the_environment_records_the_run_and_its_policy(
    entry, given, tmp_path, monkeypatch
):
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    if given == "environment":
        monkeypatch.setenv(CATALOG_URL_ENV, url)
    _save_steps(entry, tmp_path, range(1, 7), url if given == "argument" else None, **BOTH)
    assert _stored(tmp_path) == KEPT_WITH_BOTH
    with Catalog(url) as catalog:
        run = catalog.get_run(RUN)
        rows = {row.step: row.state for row in catalog.list_checkpoints(RUN)}
    assert (run.num_to_keep, run.keep_every_steps) == (2, 3)
    assert sorted(step for step, state in rows.items() if state == "committed") == KEPT_WITH_BOTH
    assert set(rows) == set(range(1, 7))  # the others recorded, then deleted


@pytest.mark.parametrize("entry", RESUMING, ids=_ids(RESUMING))
def test_resume_step_declares_where_the_job_resumes(entry, tmp_path):
    _save_steps(entry, tmp_path, range(1, 5))
    with pytest.raises(SaveBelowLatestError):  # no resume point: step 3 is below 4
        _save_steps(entry, tmp_path, [3])
    _save_steps(entry, tmp_path, [3], resume_step=2)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    assert store.run(RUN).lineage().current.resumed_from == 2
    assert store.run(RUN).latest().step == 3  # 4 was above the resume point: abandoned


def _expected_message(entry: EntryPoint, key: str, value: Any) -> str:
    """What ``zephon.retention`` (or the catalog's resolution) says of this value."""
    with pytest.raises(ConfigError) as expected:
        if key == "resume_step":
            check_resume_step(entry.owner, value)
        elif key == "catalog":
            resolve_catalog(value, entry.owner)
        else:
            Retention.checked(entry.owner, **{key: value})
    return str(expected.value)


INVALID = [
    ("num_to_keep", 0),
    ("num_to_keep", True),
    ("num_to_keep", "2"),
    ("num_to_keep", MAX_KEEP + 1),
    ("keep_every_steps", 0),
    ("keep_every_steps", -3),
    ("keep_every_steps", 1.5),
    ("resume_step", -1),
    ("resume_step", True),
    ("catalog", "catalog.db"),
]
CASES = [
    (entry, key, value)
    for entry in ENTRY_POINTS
    for key, value in INVALID
    # the manager resumes through load_latest, and its catalog is the catalog_url key
    if entry.takes_resume_step or key not in ("resume_step", "catalog")
]


@pytest.mark.parametrize(
    ("entry", "key", "value"),
    CASES,
    ids=[f"{entry.name}-{key}={value!r}" for entry, key, value in CASES],
)
def test_an_invalid_value_gets_the_one_message_naming_the_entry_point(entry, key, value, tmp_path):
    catalog = value if key == "catalog" else None
    options = {} if key == "catalog" else {key: value}
    with pytest.raises(ConfigError) as caught:
        entry.open(tmp_path, str(tmp_path / "ckpt"), catalog, **options)
    message = str(caught.value)
    assert message == _expected_message(entry, key, value)
    assert message.startswith(f"{entry.owner}{key}" if entry.owner.endswith(".") else entry.owner)
    assert "\n" not in message
    assert not os.path.exists(tmp_path / "ckpt" / RUN)  # refused before anything was written
