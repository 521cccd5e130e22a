"""ZephonCheckpointIO and the operator slips of issue 19 (item 6), with real Lightning in this
process: ``ckpt_path="last"`` (which finds no ``last.ckpt`` file here) never starts a second
history in a run, a ``validate`` from ``LATEST`` writes nothing to the run, and
``AsyncCheckpointIO`` keeps ``save_top_k``'s deletions."""

from __future__ import annotations

import os
import time
import warnings

import pytest

L = pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from zephon import SaveBelowLatestError  # noqa: E402
from zephon.integrations.lightning import LATEST, ZephonCheckpointIO  # noqa: E402
from zephon.storage import CheckpointStore  # noqa: E402

pytestmark = pytest.mark.slow

RUN = "lit"
STEPS_PER_EPOCH = 4


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    return DataLoader(data, batch_size=4)


def _trainer(tmp_path, plugin, epochs: int, top_k: int = -1) -> L.Trainer:
    checkpoints = ModelCheckpoint(
        dirpath=str(tmp_path / "names"),
        every_n_epochs=1,
        save_top_k=top_k,
        monitor="train_loss" if top_k > 0 else None,
        save_last=True,
    )
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[plugin],
        callbacks=[checkpoints],
    )


def _attempts(save_dir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(save_dir, RUN, "_attempts")))


def test_ckpt_path_last_is_refused_at_the_first_save_naming_latest_and_validate_writes_nothing(
    tmp_path,
):
    save_dir = str(tmp_path / "ckpt")
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    L.seed_everything(0, verbose=False)
    io = ZephonCheckpointIO(save_dir, RUN, catalog=catalog)
    _trainer(tmp_path, io, epochs=3).fit(Tiny(), _loader(), ckpt_path=LATEST)
    io.close()
    store = CheckpointStore(save_dir)
    assert [m.step for m in store.run(RUN).complete()] == [4, 8, 12]
    attempts = _attempts(save_dir)

    # a validate (or predict) from the latest checkpoint reads: no attempt, no decision
    io = ZephonCheckpointIO(save_dir, RUN, catalog=catalog)
    _trainer(tmp_path, io, epochs=3).validate(Tiny(), _loader(), ckpt_path=LATEST)
    io.close()
    assert _attempts(save_dir) == attempts

    # Lightning's usual "last": no last.ckpt file, so a fresh start at step 0
    io = ZephonCheckpointIO(save_dir, RUN, catalog=catalog)
    with pytest.raises(SaveBelowLatestError) as info:
        _trainer(tmp_path / "other", io, epochs=6).fit(Tiny(), _loader(), ckpt_path="last")
    io.close()
    message = str(info.value)
    assert "\n" not in message and "step 4 below its latest checkpoint 12" in message
    assert LATEST in message and "resume_step" in message
    assert [m.step for m in store.run(RUN).complete()] == [4, 8, 12]
    assert not [n for n in os.listdir(os.path.join(save_dir, RUN, "save-4")) if "e3-" in n]

    # declared: the job starts over on purpose, abandoning steps above 0
    io = ZephonCheckpointIO(save_dir, RUN, catalog=catalog, resume_step=0)
    _trainer(tmp_path / "again", io, epochs=1).fit(Tiny(), _loader())
    io.close()
    assert store.run(RUN).lineage().current.resumed_from == 0
    assert store.run(RUN).latest().step == 4


class SlowZephonCheckpointIO(ZephonCheckpointIO):
    """Saves that take longer than an epoch: Lightning's removal of an older top-k name then
    arrives (on the trainer's thread) while its save is still queued or running."""

    def save_checkpoint(self, *args, **kwargs):
        time.sleep(0.3)
        super().save_checkpoint(*args, **kwargs)


def _top_k_run(tmp_path, name: str, plugin_of) -> tuple[list[int], list[int]]:
    """A seeded 6-epoch fit with save_top_k=2 and save_last: (the steps Lightning keeps as
    top-k, the run's complete checkpoints afterwards)."""
    save_dir = str(tmp_path / name)
    L.seed_everything(0, verbose=False)
    io = plugin_of(save_dir)
    trainer = _trainer(tmp_path / f"{name}-names", io, epochs=6, top_k=2)
    trainer.fit(Tiny(), _loader(), ckpt_path=LATEST)
    kept = trainer.checkpoint_callback.best_k_models
    steps = sorted(int(p.rsplit("step=", 1)[1].split(".")[0]) for p in kept)
    return steps, [m.step for m in CheckpointStore(save_dir).run(RUN).complete()]


def test_async_checkpoint_io_keeps_the_deletions_of_save_top_k(tmp_path):
    kept, stored = _top_k_run(tmp_path, "sync", lambda d: ZephonCheckpointIO(d, RUN))
    assert len(kept) == 2 and set(kept) <= set(stored) and len(stored) <= 3  # + last.ckpt
    slow = _top_k_run(
        tmp_path, "async", lambda d: AsyncCheckpointIO(SlowZephonCheckpointIO(d, RUN))
    )
    assert slow == (kept, stored)


def test_a_fresh_start_from_latest_logs_no_restore_and_a_resume_does(tmp_path, caplog):
    """Lightning logs "Restored all states" whenever ckpt_path is truthy; with ZephonRNG a
    fresh LATEST (no checkpoint yet) clears it, a real resume keeps it. The example's folder,
    zephon-checkpoints, is not Lightning's default checkpoints/ (default_root_dir/checkpoints)."""
    from zephon.integrations.lightning import ZephonRNG

    save_dir = str(tmp_path / "zephon-checkpoints")

    def fit(epochs: int) -> list[str]:
        trainer = L.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            default_root_dir=str(tmp_path),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            plugins=[ZephonCheckpointIO(save_dir, RUN)],
            callbacks=[ZephonRNG()],
        )
        caplog.clear()
        with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Tiny(), _loader(), ckpt_path=LATEST)
        assert trainer.checkpoint_callback.dirpath == str(tmp_path / "checkpoints")
        said = [str(w.message) for w in caught]
        return [record.getMessage() for record in caplog.records] + said

    fresh = fit(1)
    assert not [m for m in fresh if "Restored all states" in m], fresh
    assert not [m for m in fresh if "exists and is not empty" in m], fresh
    resumed = fit(2)
    assert "Restored all states from the checkpoint at zephon://latest" in resumed, resumed
    assert not [m for m in resumed if "exists and is not empty" in m], resumed
    # Zephon's folder holds the run; Lightning's default folder holds nothing of it
    assert os.listdir(save_dir) == [RUN]
    assert not os.path.exists(tmp_path / "checkpoints")
    assert [m.step for m in CheckpointStore(save_dir).run(RUN).complete()] == [4, 8]
