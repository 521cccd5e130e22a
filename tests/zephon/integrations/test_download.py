"""No code runs from storage through the Hugging Face and accelerate integrations: a folder
planted where a download used to go is not used, a reused download is checked again file by
file and cleared of files its manifest does not list, temporary downloads are private and
removed, and accelerate's pickled custom states load only with the opt-in."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import pytest

from zephon import ConfigError
from zephon.integrations.accelerate import FolderCheckpoints
from zephon.integrations.download import VERIFIED, fetch_latest
from zephon.storage import CheckpointStore


@pytest.fixture
def tmpdir_here(tmp_path, monkeypatch):
    """``tempfile``'s directory moved under the test's own, to see what is left there."""
    where = tmp_path / "tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


def save_folder(save_dir, run, step, files, tmp_path, options=None) -> None:
    """``files`` committed as checkpoint ``step`` of ``run`` through the integrations' path."""
    folder = tmp_path / f"out-{run}-{step}"
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    folders = FolderCheckpoints(save_dir, run, storage_options=options)
    folders.start()
    folders.save_folder(str(folder), step)
    folders.close()


FILES = {"model.safetensors": b"weights" * 100, "sub/optimizer.bin": b"optim" * 50}


def test_a_reused_download_with_a_flipped_byte_is_downloaded_again(tmp_path):
    save_dir, local = str(tmp_path / "ckpt"), str(tmp_path / "local")
    save_folder(save_dir, "r", 4, FILES, tmp_path)
    first = fetch_latest(save_dir, "r", local_dir=local)
    assert first is not None and first.folder == os.path.join(local, "checkpoint-4")
    path = os.path.join(first.folder, "model.safetensors")
    with open(path, "r+b") as handle:
        handle.write(b"W")  # one byte changed since the last job, same size
    again = fetch_latest(save_dir, "r", local_dir=local)
    assert again is not None and again.folder == first.folder
    with open(path, "rb") as handle:
        assert handle.read() == FILES["model.safetensors"]


def test_files_the_manifest_does_not_list_are_removed_from_a_reused_download(tmp_path):
    save_dir, local = str(tmp_path / "ckpt"), str(tmp_path / "local")
    save_folder(save_dir, "r", 4, FILES, tmp_path)
    folder = fetch_latest(save_dir, "r", local_dir=local).folder
    (tmp_path / "local" / "checkpoint-4" / "custom_checkpoint_0.pkl").write_bytes(b"planted")
    (tmp_path / "local" / "checkpoint-4" / "sub" / "extra").mkdir()
    os.symlink("/etc/hostname", os.path.join(folder, "rng_state.pth"))
    assert fetch_latest(save_dir, "r", local_dir=local).folder == folder
    found = sorted(
        os.path.relpath(os.path.join(root, name), folder)
        for root, dirs, names in os.walk(folder)
        for name in names + dirs
    )
    assert found == sorted([VERIFIED, "model.safetensors", "sub", "sub/optimizer.bin"])


def test_a_checkpoint_verified_in_place_with_an_unlisted_file_is_refused(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    save_folder(save_dir, "r", 4, FILES, tmp_path)
    save_folder(save_dir, "r", 8, FILES, tmp_path)
    payload = CheckpointStore(save_dir).run("r").reader(8).path
    with open(os.path.join(payload, "custom_checkpoint_0.pkl"), "wb") as out:
        out.write(b"planted")
    found = fetch_latest(save_dir, "r")
    assert found is not None and found.step == 4  # 8 is quarantined, the older one taken


def test_a_temporary_download_is_private_and_removed(s3_backend, tmp_path, tmpdir_here):
    from zephon.integrations.huggingface import latest_checkpoint, remove_temporary_downloads

    options = s3_backend.storage_options
    save_folder(s3_backend.url, "r", 4, FILES, tmp_path, options)
    found = fetch_latest(s3_backend.url, "r", storage_options=options)
    assert found is not None and found.temporary == os.path.dirname(found.folder)
    assert stat.S_IMODE(os.stat(found.temporary).st_mode) == 0o700
    assert os.path.dirname(found.temporary) == str(tmpdir_here)
    found.remove()
    assert os.listdir(tmpdir_here) == []
    folder = latest_checkpoint(s3_backend.url, "r", storage_options=options)
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    remove_temporary_downloads()  # as ZephonCallback.on_train_end does
    assert os.listdir(tmpdir_here) == []


# -- accelerate ---------------------------------------------------------------------------------


class Counter:
    """An object registered with accelerate: its state is pickled as custom_checkpoint_0.pkl."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def accelerated(seed: int, counter: Counter | None = None):
    torch = pytest.importorskip("torch")
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    accelerator = accelerate.Accelerator(cpu=True)
    model = accelerator.prepare(model)
    if counter is not None:
        accelerator.register_for_checkpointing(counter)
    return accelerator, model


def test_a_folder_planted_at_the_old_predictable_path_is_not_used(tmp_path, tmpdir_here):
    """accelerate used to download into $TMPDIR/zephon-<run>/load-<rank> and reuse a folder
    there on its save id and file sizes: another user of the host could plant one."""
    import torch

    from zephon.integrations.accelerate import AcceleratorCheckpoints

    save_dir = str(tmp_path / "ckpt")
    accelerator, model = accelerated(0)
    saved = model.weight.detach().clone()
    checkpoints = AcceleratorCheckpoints(accelerator, save_dir, "acc")
    checkpoints.save_state(2)
    checkpoints.close()
    manifest = CheckpointStore(save_dir).run("acc").latest()
    planted = tmpdir_here / "zephon-acc" / "load-0" / "checkpoint-2"
    shutil.copytree(CheckpointStore(save_dir).run("acc").reader(2).path, planted)
    (planted / VERIFIED).write_text(manifest.save_id)
    other, other_model = accelerated(1)  # other weights, the same file sizes
    other.save_state(str(tmp_path / "other"))
    shutil.copy(tmp_path / "other" / "model.safetensors", planted / "model.safetensors")

    accelerator, model = accelerated(2)
    checkpoints = AcceleratorCheckpoints(accelerator, save_dir, "acc")
    assert checkpoints.load_state() == 2
    checkpoints.close()
    assert torch.equal(model.weight.detach(), saved)
    assert not torch.equal(other_model.weight.detach(), saved)
    assert sorted(os.listdir(tmpdir_here)) == ["zephon-acc"]  # nothing of ours left behind


def test_accelerate_custom_states_load_only_with_the_opt_in(s3_backend, tmp_path, tmpdir_here):
    from zephon.integrations.accelerate import AcceleratorCheckpoints

    options = {"storage_options": s3_backend.storage_options}
    counter = Counter()
    accelerator, _ = accelerated(0, counter)
    counter.count = 7
    checkpoints = AcceleratorCheckpoints(accelerator, s3_backend.url, "acc", **options)
    checkpoints.save_state(3)
    checkpoints.close()

    restored = Counter()
    accelerator, _ = accelerated(0, restored)
    refused = AcceleratorCheckpoints(accelerator, s3_backend.url, "acc", **options)
    with pytest.raises(ConfigError, match=r"custom_checkpoint_0\.pkl.*trust_custom_states=True"):
        refused.load_state()
    refused.close()
    assert restored.count == 0
    trusted = AcceleratorCheckpoints(
        accelerator, s3_backend.url, "acc", trust_custom_states=True, **options
    )
    assert trusted.load_state() == 3
    trusted.close()
    assert restored.count == 7
    assert os.listdir(tmpdir_here) == []  # downloads and staging removed
