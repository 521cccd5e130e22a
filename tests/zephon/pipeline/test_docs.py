"""docs/pipeline.md and examples/pipeline_*.py run as printed, and the documented state is real."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
DOC = os.path.join(ROOT, "docs", "pipeline.md")


def _blocks(language: str) -> list[str]:
    with open(DOC, encoding="utf-8") as handle:
        return re.findall(rf"```{language}\n(.*?)```", handle.read(), re.S)


def test_the_quick_start_runs_and_its_state_is_the_one_documented():
    namespace: dict = {}
    exec(compile(_blocks("python")[0], DOC, "exec"), namespace)
    pipeline = namespace["build"]()
    it = iter(pipeline)
    for _ in range(10):
        next(it)
    assert pipeline.checkpoint() == json.loads(_blocks("json")[0])
    pipeline.close()


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "pipeline_*.py"))))
def test_examples_run(path):
    out = subprocess.run(
        [sys.executable, path], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
