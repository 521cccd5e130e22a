"""``import zephon`` and ``zephon.integrations`` import no training framework: each integration
loads its framework only when it is used, so a job that uses none of them never pays for them.

Each framework is checked in a fresh interpreter, and only where it is installed: where it is
not, it could not have been imported and the check would prove nothing. The same interpreter
then imports the framework, so a check that passed also shows it could have failed. torchtitan
lives in an environment of its own (``.ci/torchtitan`` runs this file there with
``ZEPHON_REQUIRE_TORCHTITAN=1``, which makes a missing torchtitan fail, not drop out).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FRAMEWORKS = ("lightning", "torchtitan", "transformers", "accelerate")


def required(framework: str) -> bool:
    """Installed here, or required to be (then a missing one fails the test)."""
    if os.environ.get(f"ZEPHON_REQUIRE_{framework.upper()}") == "1":
        return True
    return importlib.util.find_spec(framework) is not None


@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if required(f)])
def test_import_zephon_never_imports_the_framework(framework):
    code = (
        "import sys, zephon, zephon.integrations\n"
        f"loaded = {framework!r} in sys.modules\n"
        f"import {framework}\n"  # installed: the check above could have been True
        "print(loaded)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False", f"import zephon imported {framework}"
