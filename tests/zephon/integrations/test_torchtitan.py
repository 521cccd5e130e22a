"""torchtitan 0.3.0's trainer with ``zephon_checkpointer`` switched on by its own
``--override.imports``: the llama3 debug model on two gloo ranks, SIGKILLed between the files
and the marker of a save (sync on local disk with SQLite; async, while the next steps train, on
S3 via moto with storage options and catalog from the environment), resumes from the latest
complete checkpoint with the losses of an uninterrupted run of stock torchtitan; retention
counts committed checkpoints only.

torchtitan lives in its own environment (it caps fsspec through ``datasets<4.8``), so this file
is not collected where it is not installed (``conftest.py``), unless
``ZEPHON_REQUIRE_TORCHTITAN=1`` (set by ``.ci/torchtitan``), which makes a missing torchtitan
fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

if os.environ.get("ZEPHON_REQUIRE_TORCHTITAN") == "1":
    import torchtitan  # noqa: F401  # must be there: fail, do not skip
else:
    pytest.importorskip("torchtitan")

from zephon.storage import CheckpointStore  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WORKER = os.path.join(HERE, "torchtitan_worker.py")
STEPS = 8
TARGET = "zephon.integrations.torchtitan.zephon_checkpointer"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("tt-assets"))
    done = subprocess.run(
        [sys.executable, WORKER, "make-assets", folder], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def run_titan(tmp, assets, *flags, env=None, killed=False, timeout=150) -> list[tuple[int, float]]:
    """torchrun two ranks of the worker with torchtitan ``flags``; returns the ``(step, loss)``
    rank 0 logged. ``killed``: rank 0 must have died of SIGKILL."""
    losses = os.path.join(tmp, f"losses-{len(os.listdir(tmp))}.txt")
    open(losses, "w").close()
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([HERE, REPO]),
        "TT_ASSETS": assets,
        "TT_LOSSES": losses,
        "TT_STEPS": str(STEPS),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
        *(WORKER, "--module", "torchtitan_worker", "--config", "zephon_debug"),
        *flags,
    ]
    done = subprocess.run(
        cmd, env=environment, cwd=tmp, capture_output=True, text=True, timeout=timeout
    )
    output = done.stdout + done.stderr
    if killed:
        assert done.returncode != 0 and "Signal 9 (SIGKILL)" in output, output[-4000:]
    else:
        assert done.returncode == 0, output[-4000:]
    return read_losses(losses)


def read_losses(path) -> list[tuple[int, float]]:
    with open(path) as handle:
        return [(int(s), float(v)) for s, v in (line.split() for line in handle)]


def zephon_flags(dump: str, **options) -> list[str]:
    target = f"{TARGET}={json.dumps(options)}" if options else TARGET
    return ["--dump_folder", dump, "--override.imports", target]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, assets) -> dict[int, float]:
    """Stock torchtitan (its own checkpointer, step-N folders), uninterrupted."""
    tmp = str(tmp_path_factory.mktemp("tt-reference"))
    found = run_titan(tmp, assets, "--dump_folder", os.path.join(tmp, "out"))
    assert [s for s, _ in found] == list(range(1, STEPS + 1))
    assert os.path.isdir(os.path.join(tmp, "out", "checkpoint", "step-8"))
    return dict(found)


def committed_rows(catalog_url: str, run: str) -> list[int]:
    from zephon.catalog import Catalog

    with Catalog(catalog_url) as opened:
        return [r.step for r in opened.list_checkpoints(run, states="committed")]


def test_sigkill_between_files_and_marker_resumes_with_equal_losses(tmp_path, assets, reference):
    tmp, dump = str(tmp_path), str(tmp_path / "out")
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    flags = zephon_flags(dump, catalog=catalog, num_to_keep=2)
    first = run_titan(tmp, assets, *flags, env={"TT_KILL_IN_SAVE_OF": "6"}, killed=True)
    assert [s for s, _ in first] == list(range(1, 7))
    store = CheckpointStore(dump)
    # checkpoint.folder is the run: <dump_folder>/checkpoint; save-6 has its files, no marker
    assert store.run("checkpoint").committed_steps() == [2, 4]
    assert os.listdir(os.path.join(dump, "checkpoint", "save-6"))
    resumed = run_titan(tmp, assets, *flags)
    assert [s for s, _ in resumed] == list(range(5, STEPS + 1))
    assert {**dict(first), **dict(resumed)} == reference
    assert store.run("checkpoint").committed_steps() == [6, 8]
    assert committed_rows(catalog, "checkpoint") == [6, 8]
    assert not any(n.startswith("step-") for n in os.listdir(os.path.join(dump, "checkpoint")))


def test_keep_every_steps_keeps_the_milestones_with_the_catalog_from_the_environment(
    tmp_path, assets
):
    """The retention options of every entry point (tests/zephon/test_entry_points.py) through
    the override's JSON: num_to_keep=1 with keep_every_steps=4 keeps 4 and 8 of the saves 2,
    4, 6, 8; the catalog named by $ZEPHON_CATALOG_URL holds the rows and the run's policy."""
    from zephon.catalog import Catalog

    tmp, dump = str(tmp_path), str(tmp_path / "out")
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    flags = zephon_flags(dump, num_to_keep=1, keep_every_steps=4)
    found = run_titan(tmp, assets, *flags, env={"ZEPHON_CATALOG_URL": catalog})
    assert [s for s, _ in found] == list(range(1, STEPS + 1))
    assert CheckpointStore(dump).run("checkpoint").committed_steps() == [4, 8]
    assert committed_rows(catalog, "checkpoint") == [4, 8]
    with Catalog(catalog) as opened:
        run = opened.get_run("checkpoint")
    assert (run.num_to_keep, run.keep_every_steps) == (1, 4)


def test_storage_reads_markers_with_this_s3fs(s3_backend):
    """The storage layer on this environment's s3fs (datasets<4.8 holds it at an older release
    than the main environment's, whose cat_file takes other arguments)."""
    store = s3_backend.open_store()
    with store.run("r").begin(1) as writer:
        writer.write_bytes("a.bin", b"x")
        writer.commit()
    assert store.run("r").latest().step == 1


def test_async_save_sigkilled_while_training_on_s3_resumes_from_the_catalogs_latest(
    tmp_path, assets, reference, s3_backend
):
    """checkpoint.async_mode=async: rank 0 dies between the files and the marker of step 6,
    whose save runs in the background while the next steps train. checkpoint.folder is an s3:// URL;
    storage options come from $ZEPHON_STORAGE_OPTIONS and the catalog from
    $ZEPHON_CATALOG_URL; keep_latest_k=2 becomes num_to_keep."""
    tmp = str(tmp_path)
    folder = f"{s3_backend.url}/titan-run"
    env = {
        "ZEPHON_STORAGE_OPTIONS": json.dumps(s3_backend.storage_options),
        "ZEPHON_CATALOG_URL": f"sqlite:///{tmp_path / 'catalog.db'}",
    }
    flags = [
        *zephon_flags(str(tmp_path / "out")),
        *("--checkpoint.folder", folder, "--checkpoint.keep_latest_k", "2"),
        *("--checkpoint.async_mode", "async"),
    ]
    first = run_titan(tmp, assets, *flags, env={**env, "TT_KILL_IN_SAVE_OF": "6"}, killed=True)
    # the save of step 6 overlaps the next steps (on S3 it may last until the last step's
    # save waits for it): steps 7 and 8 may be logged before the kill
    assert [s for s, _ in first] == list(range(1, len(first) + 1)) and 6 <= len(first) <= STEPS
    store = CheckpointStore(s3_backend.url, s3_backend.storage_options)
    assert store.run("titan-run").committed_steps() == [2, 4]
    resumed = run_titan(tmp, assets, *flags, env=env)
    assert [s for s, _ in resumed] == list(range(5, STEPS + 1))
    assert {**dict(first), **dict(resumed)} == reference
    assert store.run("titan-run").committed_steps() == [6, 8]
    assert committed_rows(env["ZEPHON_CATALOG_URL"], "titan-run") == [6, 8]


def test_override_carries_the_config_over_and_errors_name_the_fix():
    from torchtitan.components.checkpointer import CheckpointManager

    from zephon.errors import ConfigError
    from zephon.integrations.torchtitan import ZephonCheckpointManager, zephon_checkpointer
    from zephon.retention import Retention

    stock = CheckpointManager.Config(enable=True, folder="s3://b/ckpt/r", interval=7)
    cfg = zephon_checkpointer(
        stock, catalog="postgresql://u:hunter2@db/zephon", storage_options={"secret": "s3cr3t"}
    )
    assert isinstance(cfg, ZephonCheckpointManager.Config)
    assert (cfg.enable, cfg.folder, cfg.interval, cfg.keep_latest_k) == (True, stock.folder, 7, 10)
    shown = json.dumps(cfg.to_dict())
    assert "hunter2" not in shown and "s3cr3t" not in shown
    with pytest.raises(ConfigError, match="num_to_keep = 0 is invalid"):
        zephon_checkpointer(stock, num_to_keep=0)
    kept = zephon_checkpointer(stock, num_to_keep=2, keep_every_steps=3)
    assert (kept.num_to_keep, kept.keep_every_steps) == (2, 3)
    for key, value in [("num_to_keep", True), ("keep_every_steps", 0), ("keep_every_steps", "3")]:
        with pytest.raises(ConfigError) as caught:
            zephon_checkpointer(stock, **{key: value})
        with pytest.raises(ConfigError) as expected:  # the one message of every entry point
            Retention.checked("zephon_checkpointer", **{key: value})
        assert str(caught.value) == str(expected.value)
    with pytest.raises(ConfigError, match="zephon_checkpointer catalog = 'catalog.db'"):
        zephon_checkpointer(stock, catalog="catalog.db")
    with pytest.raises(ConfigError, match="last_save_in_hf is not supported"):
        zephon_checkpointer(
            CheckpointManager.Config(last_save_in_hf=True, last_save_model_only=True)
        )


def test_docs_example_runs_as_printed(tmp_path):
    with open(os.path.join(REPO, "docs", "torchtitan.md")) as handle:
        text = handle.read()
    code = text.split("```bash\n", 1)[1].split("```", 1)[0]
    expected = text.split("prints\n\n```\n", 1)[1].split("```", 1)[0]
    # the activation line names the venv .ci/torchtitan makes; here it is the running one
    assert code.startswith(". .venv-torchtitan/bin/activate\n")
    code = code.split("\n", 1)[1]
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=REPO,
        env={**os.environ, "PATH": path, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout == expected
