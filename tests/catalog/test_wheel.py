"""The built wheel carries the migrations: install it into a fresh venv and create a catalog
from a directory outside the repository."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import unavailable
from zephon import catalog

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "README.md", "zephon", "storage", "catalog", "migrations"]

PROBE = """
import json, sys
from zephon import catalog, migrations
before = catalog.current_revision(sys.argv[1])
after = catalog.upgrade(sys.argv[1])
with catalog.Catalog(sys.argv[1]) as opened:
    opened.ensure_run("wheel-run", "/ckpt/wheel-run")
    runs = [s.run.name for s in opened.list_runs()]
print(json.dumps({"catalog": catalog.__file__, "migrations": migrations.__file__,
                  "before": before, "after": after, "runs": runs}))
"""


def _run(argv: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _can_build_wheels_offline() -> bool:
    # setuptools >= 70.1 builds wheels itself; older ones need the `wheel` package.
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) >= (70, 1):
        return True
    return importlib.util.find_spec("wheel") is not None


@pytest.mark.slow
def test_the_installed_wheel_creates_a_catalog_from_any_directory(tmp_path):
    if not _can_build_wheels_offline():
        unavailable(
            "building a wheel without network needs setuptools>=70.1 (or the wheel package) "
            "in this environment: pip install 'setuptools>=70.1'"
        )
    # Build from a copy, so parallel work in the shared tree never sees build/ or egg-info.
    source = tmp_path / "src"
    for name in SOURCES:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(
                origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(origin, source / name)
    dist = tmp_path / "dist"
    # No isolation: no network here. The dependency check is skipped because setuptools >= 70.1
    # builds wheels itself; the separate `wheel` package named in build-system is not needed.
    _run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--skip-dependency-check",
            "--outdir",
            str(dist),
            str(source),
        ],
        cwd=tmp_path,
    )
    [wheel] = dist.glob("zephon-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "migrations/__init__.py",
        "migrations/env.py",
        "migrations/script.py.mako",
        "migrations/alembic.ini",
        "catalog/schema.py",
    ):
        assert required in names, required
    assert any(n.startswith("migrations/versions/") and n.endswith("_initial.py") for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            str(wheel),
        ],
        cwd=tmp_path,
    )
    # Dependencies come from the dev environment's site-packages, appended as a plain path:
    # its .pth files (the editable install of this repository) are not processed that way.
    fresh_site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=tmp_path,
        ).strip()
    )
    (fresh_site / "zz_dev_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    database = tmp_path / "data" / "catalog.db"
    out = json.loads(_run([str(python), "-c", PROBE, f"sqlite:///{database}"], cwd=elsewhere))
    assert Path(out["catalog"]).is_relative_to(venv), out
    assert Path(out["migrations"]).is_relative_to(venv), out
    assert out["before"] is None
    assert out["after"] == [None, catalog.head_revision()]
    assert out["runs"] == ["wheel-run"]
    assert database.exists()
