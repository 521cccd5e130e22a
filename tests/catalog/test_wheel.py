"""The built wheel carries the migrations: install it into a fresh venv and create a catalog
from a directory outside the repository."""

from __future__ import annotations

import json
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.wheels import build_wheel, run
from zephon import catalog

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


@pytest.mark.slow
def test_the_installed_wheel_creates_a_catalog_from_any_directory(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "zephon/migrations/__init__.py",
        "zephon/migrations/env.py",
        "zephon/migrations/script.py.mako",
        "zephon/migrations/alembic.ini",
        "zephon/catalog/schema.py",
    ):
        assert required in names, required
    assert any(
        n.startswith("zephon/migrations/versions/") and n.endswith("_initial.py") for n in names
    )

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    run(
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
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=tmp_path,
        ).strip()
    )
    (fresh_site / "zz_dev_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    database = tmp_path / "data" / "catalog.db"
    out = json.loads(run([str(python), "-c", PROBE, f"sqlite:///{database}"], cwd=elsewhere))
    assert Path(out["catalog"]).is_relative_to(venv), out
    assert Path(out["migrations"]).is_relative_to(venv), out
    assert out["before"] is None
    assert out["after"] == [None, catalog.head_revision()]
    assert out["runs"] == ["wheel-run"]
    assert database.exists()
