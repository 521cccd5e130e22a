"""The saves outside the manager and the DCP writer send their last files with the commit's
fence re-check (``commit(files=...)``, docs/fencing.md's commit rule): Lightning's
``ZephonCheckpointIO``, accelerate's ``FolderCheckpoints`` in one process, ``adopt`` and the
local tier's upload of a one-rank job. Each is counted on moto's S3 server behind
``benchmarks/latency_proxy.py`` (``longest_chain``: requests sent together are one link); the
tests assert the chain up to the marker and that nothing is written after the fence re-check
but the marker, never times. Each fails on the code that wrote the files before ``commit()``
(chains 4, 4, 6 and 4 there).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.conftest import Backend
from zephon.storage import CheckpointStore, CorruptCheckpointError, FileEntry, crc32c_of

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from latency_proxy import LatencyProxy  # noqa: E402

#: held back only while measuring: long enough that requests sent together reach the proxy
#: well within it on a busy machine
DELAY_MS = 500


def through(backend: Backend, proxy: LatencyProxy) -> dict:
    options = json.loads(json.dumps(backend.storage_options))
    options["client_kwargs"]["endpoint_url"] = proxy.url
    return options


def measure(proxy: LatencyProxy) -> None:
    proxy.reset()
    proxy.delay_ms = DELAY_MS


def up_to_the_marker(proxy: LatencyProxy, step: int) -> list[str]:
    """The requests sent, checked to end with the step's marker (nothing written after it);
    the caller then asserts ``proxy.longest_chain``."""
    proxy.delay_ms = 0
    lines = proxy.request_lines
    markers = [i for i, line in enumerate(lines) if f"/save-{step}/_COMMIT" in line]
    assert markers and lines[markers[-1]].startswith("PUT "), lines
    assert not any(line.startswith("PUT ") for line in lines[markers[-1] + 1 :]), lines
    return lines


@pytest.mark.slow  # a proxy holding each request back, and a framework's import
def test_lightning_sends_its_two_files_with_the_fence_check(s3_backend, sqlite_catalog):
    from zephon.integrations.lightning import ZephonCheckpointIO

    state = {"global_step": 1, "state_dict": {"w": torch.arange(6.0)}, "epoch": 0}
    with LatencyProxy(s3_backend.storage_options["client_kwargs"]["endpoint_url"], 0) as proxy:
        io = ZephonCheckpointIO(
            s3_backend.url, "lt", catalog=sqlite_catalog, storage_options=through(s3_backend, proxy)
        )
        io.save_checkpoint(state, "a.ckpt")  # registers the attempt
        measure(proxy)
        io.save_checkpoint({**state, "global_step": 2}, "b.ckpt")
        lines = up_to_the_marker(proxy, 2)
        # begin's fence check and marker probe; both files with the fence re-check; the marker
        assert proxy.longest_chain == 3, lines
        io.close()
    loaded = ZephonCheckpointIO(s3_backend.url, "lt", storage_options=s3_backend.storage_options)
    state = loaded.load_checkpoint("zephon://lt/2")
    assert torch.equal(state["state_dict"]["w"], torch.arange(6.0))


@pytest.mark.slow  # a proxy holding each request back, and a framework's import
def test_accelerate_in_one_process_sends_its_folder_with_the_fence_check(
    s3_backend, sqlite_catalog, tmp_path
):
    from zephon.integrations.accelerate import FolderCheckpoints

    folder = tmp_path / "out"
    (folder / "sub").mkdir(parents=True)
    files = {"model.safetensors": b"w" * 3000, "sub/optimizer.bin": b"o" * 500, "rng.pkl": b"r"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    with LatencyProxy(s3_backend.storage_options["client_kwargs"]["endpoint_url"], 0) as proxy:
        options = through(s3_backend, proxy)
        folders = FolderCheckpoints(
            s3_backend.url, "acc", catalog=sqlite_catalog, storage_options=options
        )
        folders.start()
        folders.save_folder(str(folder), 1)  # registers the attempt
        measure(proxy)
        folders.save_folder(str(folder), 2)
        lines = up_to_the_marker(proxy, 2)
        assert proxy.longest_chain == 3, lines
        folders.close()
    reader = s3_backend.open_store().run("acc").reader(2)
    assert {name: reader.read_bytes(name) for name in reader.names} == files


@pytest.mark.slow  # a proxy holding each request back, and a framework's import
def test_adopt_sends_the_metadata_with_the_fence_check(s3_backend, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from zephon import adopt as adopting
    from zephon import dcp as zd

    state = {f"t{i}": torch.full((8,), float(i)) for i in range(3)}
    for step in (1, 2):  # torchtitan's layout: the first step's save registers the attempt
        dcp.save(state, checkpoint_id=str(tmp_path / "titan" / f"step-{step}"))
    with LatencyProxy(s3_backend.storage_options["client_kwargs"]["endpoint_url"], 0) as proxy:
        adopt_step = adopting._adopt_step

        def counted(*args, **kwargs):  # each step's save alone: the last one is measured
            measure(proxy)
            return adopt_step(*args, **kwargs)

        monkeypatch.setattr(adopting, "_adopt_step", counted)
        run_url = f"{s3_backend.url}/ad"
        adopting.adopt(str(tmp_path / "titan"), run_url, storage_options=through(s3_backend, proxy))
        lines = up_to_the_marker(proxy, 2)
    # begin's fence check and marker probe; the shard; both metadata files with the payload
    # listing and the fence re-check; the marker (before: the metadata files one after the
    # other, then the checks: 6)
    assert proxy.longest_chain == 4, lines
    target = {k: torch.zeros(8) for k in state}
    with zd.Reader(run_url, step=2, storage_options=s3_backend.storage_options) as reader:
        zd.load(target, reader)
    assert all(torch.equal(target[k], state[k]) for k in state)
    manifest = s3_backend.open_store().run("ad").read_manifest(2)
    assert set(manifest.inline) == {"dcp_metadata.json"}  # as a DCP save's marker


@pytest.mark.slow  # a proxy holding each request back, and a framework's import
def test_a_one_rank_upload_of_the_local_tier_sends_its_files_with_the_fence_check(
    s3_backend, tmp_path
):
    from zephon.checkpointing import CheckpointManager
    from zephon.config import CheckpointingConfig

    state = {"model": torch.nn.Linear(4, 3), "notes": {"step": 1}}
    with LatencyProxy(s3_backend.storage_options["client_kwargs"]["endpoint_url"], 0) as proxy:
        cfg = CheckpointingConfig(
            save_dir=s3_backend.url,
            storage_options=through(s3_backend, proxy),
            local_dir=str(tmp_path / "local"),
        )
        with CheckpointManager(cfg, run_name="tier", total_steps=10) as manager:
            manager.save(1, state)
            manager.wait()
            measure(proxy)
            manager.save(2, state)
            manager.wait()
            lines = up_to_the_marker(proxy, 2)
            chain = proxy.longest_chain
    # begin's fence check and marker probe; the files with the fence re-check; the marker
    assert chain == 3, lines
    assert s3_backend.open_store().run("tier").committed_steps() == [1, 2]


def test_a_damaged_local_file_sent_with_the_commit_is_never_published(tmp_path):
    from zephon.destinations.local.transfer import verified_sources

    local = tmp_path / "local"
    local.mkdir()
    (local / "a.bin").write_bytes(b"abc")
    (local / "b.bin").write_bytes(b"xyz")
    entries = [
        FileEntry("a.bin", 3, crc32c_of(b"abc")),
        FileEntry("b.bin", 3, crc32c_of(b"xyZ")),  # the bytes on disk changed since
    ]
    store = CheckpointStore(str(tmp_path / "remote"))
    writer = store.run("r").begin(1)
    with pytest.raises(CorruptCheckpointError, match="b.bin"):
        writer.commit(files=verified_sources(entries, str(local), writer))
    payload = tmp_path / "remote" / "r" / "save-1" / writer.save_id
    assert not (payload / "b.bin").exists()
    assert store.run("r").committed_steps() == []
    writer.abort()
    missing = [FileEntry("gone.bin", 1, crc32c_of(b"g"))]
    writer = store.run("r").begin(2)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        writer.commit(files=verified_sources(missing, str(local), writer))
    writer.abort()
