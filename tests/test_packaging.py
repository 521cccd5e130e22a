"""Zephon's import names never collide with a user's: the layers install as ``zephon.storage``,
``zephon.catalog`` and ``zephon.migrations``, so a training script's own ``storage.py``,
``catalog/`` or ``migrations/`` (common names) beside it changes nothing.

Each check runs in a fresh interpreter whose working directory holds such modules, each of which
fails loudly when imported: were Zephon to import a top-level ``storage``, the run would fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: the user's modules that shadow common names; importing any of them is a failure
SHADOWS = {
    "storage.py": "raise ImportError('the user storage.py was imported')\n",
    "catalog/__init__.py": "raise ImportError('the user catalog/ was imported')\n",
    "migrations/__init__.py": "raise ImportError('the user migrations/ was imported')\n",
    "errors.py": "raise ImportError('the user errors.py was imported')\n",
}


def packages_on_disk() -> set[str]:
    """Every package folder of the repository, named as it installs."""
    names = set()
    for top, installed in (
        ("zephon", "zephon"),
        ("storage", "zephon.storage"),
        ("catalog", "zephon.catalog"),
        ("migrations", "zephon.migrations"),
    ):
        for init in (REPO / top).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / top).parts
            names.add(".".join((installed, *parts)))
    return names


def test_pyproject_lists_every_package_folder():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == packages_on_disk()
    assert config["package-dir"] == {
        "zephon.storage": "storage",
        "zephon.catalog": "catalog",
        "zephon.migrations": "migrations",
    }


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """A training script's directory holding a storage.py, catalog/ and migrations/ of its own."""
    for name, text in SHADOWS.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done


def test_the_shadowing_modules_do_break_a_top_level_import(user_dir: Path):
    """The fixture can fail: a plain ``import storage`` from that directory meets the user's."""
    done = subprocess.run(
        [sys.executable, "-c", "import storage"], cwd=user_dir, capture_output=True, text=True
    )
    assert done.returncode != 0 and "the user storage.py was imported" in done.stderr


SCRIPT = """
import json, sys
import zephon
from zephon import ZephonError, StorageError, CatalogError
from zephon.storage import CheckpointStore
from zephon.catalog import Catalog
import zephon.migrations
import zephon.dcp as zd
import torch
import torch.distributed.checkpoint as dcp

run = sys.argv[1] + "/runs/r"
with Catalog("sqlite:///" + sys.argv[1] + "/catalog.db") as catalog:
    writer = zd.Writer(run, step=1, catalog=catalog)
    dcp.save({"w": torch.arange(4.0)}, storage_writer=writer, checkpoint_id=run + "/save-1")
    writer.close()
    state = {"w": torch.zeros(4)}
    dcp.load(state, storage_reader=zd.Reader(run, catalog=catalog))
    step = catalog.latest_committed("r").step
user = [m for m in sys.modules if m.split(".")[0] in ("storage", "catalog", "migrations")]
print(json.dumps({"w": state["w"].tolist(), "step": step, "user": user}))
"""


def test_import_save_and_load_from_a_directory_with_its_own_storage_and_catalog(user_dir: Path):
    done = _run([sys.executable, "-c", SCRIPT, str(user_dir)], cwd=user_dir)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"w": [0.0, 1.0, 2.0, 3.0], "step": 1, "user": []}


def test_the_command_works_from_a_directory_with_its_own_storage_and_catalog(user_dir: Path):
    zephon = Path(sys.executable).with_name("zephon")
    catalog = f"sqlite:///{user_dir}/cli.db"
    _run([str(zephon), "db", "upgrade", "--catalog", catalog], cwd=user_dir)
    done = _run([str(zephon), "runs", "--catalog", catalog, "--json"], cwd=user_dir)
    assert json.loads(done.stdout) == []


@pytest.mark.parametrize(
    "module",
    [
        "zephon.integrations.huggingface",
        "zephon.integrations.accelerate",
        "zephon.integrations.lightning",
        "zephon.pipeline",
        "zephon.cli",
    ],
)
def test_every_integration_imports_from_a_directory_with_its_own_modules(user_dir, module):
    _run([sys.executable, "-c", f"import {module}"], cwd=user_dir)


def test_importing_storage_loads_neither_the_catalog_nor_torch():
    code = (
        "import sys, zephon.storage, zephon.storage.backends\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sqlalchemy')\n"
        "             or m.startswith('zephon.') and not m.startswith('zephon.storage'))\n"
        "print(','.join(bad))\n"
    )
    done = _run([sys.executable, "-c", code], cwd=REPO)
    assert done.stdout.strip() == ""
