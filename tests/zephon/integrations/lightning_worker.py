"""A tiny seeded Lightning run through ZephonCheckpointIO, for the tests: dropout, a shuffled
DataLoader, a checkpoint every epoch. Appends ``global_step loss`` lines to LOSSES.

    python lightning_worker.py SAVE_DIR RUN LOSSES [--catalog URL] [--storage-options JSON]
        [--epochs N] [--kill-at-step S] [--kill-in-save-of S] [--top-k K] [--keep N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zephon.integrations.lightning import LATEST, ZephonCheckpointIO, ZephonRNG

STEPS_PER_EPOCH = 4


class Tiny(L.LightningModule):
    def __init__(self, losses: str, kill_at_step: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
        self.losses, self.kill_at_step = losses, kill_at_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        with open(self.losses, "a") as out:
            out.write(f"{self.global_step + 1} {loss.item()!r}\n")
        if self.kill_at_step is not None and self.global_step + 1 == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("save_dir")
    p.add_argument("run")
    p.add_argument("losses")
    p.add_argument("--catalog")
    p.add_argument("--storage-options", default="{}")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--kill-at-step", type=int)
    p.add_argument("--kill-in-save-of", type=int)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--keep", type=int)
    a = p.parse_args()
    if a.kill_in_save_of is not None:
        # Fault injection: SIGKILL between the files (sent with the commit's fence re-check)
        # and the marker of one save.
        from zephon import storage

        real_marker = storage.CheckpointWriter._create_marker

        def create_marker(self, data):
            if self.step == a.kill_in_save_of:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_marker(self, data)

        storage.CheckpointWriter._create_marker = create_marker
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model = Tiny(a.losses, a.kill_at_step)
    io = ZephonCheckpointIO(
        a.save_dir,
        a.run,
        catalog=a.catalog,
        storage_options=json.loads(a.storage_options),
        num_to_keep=a.keep,
    )
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(os.path.dirname(a.losses), "names"),
        every_n_epochs=1,
        save_top_k=a.top_k,
        monitor="train_loss" if a.top_k > 0 else None,
        save_last=True,
    )
    trainer = L.Trainer(
        max_epochs=a.epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[checkpoints, ZephonRNG()],
    )
    trainer.fit(model, loader, ckpt_path=LATEST)
    io.close()


if __name__ == "__main__":
    main()
