"""Zephon's wheel, built from a copy of the repository, for the tests that install it into a
fresh environment (tests/catalog/test_wheel.py, tests/test_extras.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import unavailable

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "zephon", "storage", "catalog", "migrations"]


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 600) -> str:
    """Run ``argv`` without this environment's PYTHONPATH; its stdout, or a failure showing
    both streams."""
    clean = {k: v for k, v in (env or os.environ).items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(argv, cwd=cwd, env=clean, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
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


def build_wheel(workdir: Path) -> Path:
    """Build Zephon's wheel in ``workdir`` from a copy of the sources (so parallel work in the
    shared tree never sees build/ or egg-info) and return its path."""
    if not _can_build_wheels_offline():
        unavailable(
            "building a wheel without network needs setuptools>=70.1 (or the wheel package) "
            "in this environment: pip install 'setuptools>=70.1'"
        )
    source = workdir / "src"
    for name in SOURCES:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(
                origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, source / name)
    dist = workdir / "dist"
    # No isolation: no network here. The dependency check is skipped because setuptools >= 70.1
    # builds wheels itself; the separate `wheel` package named in build-system is not needed.
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation"]
    run([*build, "--skip-dependency-check", "--outdir", str(dist), str(source)], cwd=workdir)
    [wheel] = dist.glob("zephon-*.whl")
    return wheel
