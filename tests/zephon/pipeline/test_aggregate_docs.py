"""docs/pipeline.md "Distributed checkpoints (many ranks)": its example prints what the page says
(two gloo ranks over aggregate_store="torch://", the same state on both, restore on both)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.zephon.test_docs import _EXAMPLE

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
DOC = os.path.join(ROOT, "docs", "pipeline.md")
SECTION = "## Distributed checkpoints (many ranks)"


def _section_examples() -> list[tuple[str, str]]:
    with open(DOC, encoding="utf-8") as handle:
        text = handle.read()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return [(m.group("code"), m.group("out")) for m in _EXAMPLE.finditer(text[start:end])]


def test_the_distributed_example_prints_what_the_page_says(tmp_path):
    [(code, expected)] = _section_examples()
    assert 'aggregate_store="torch://"' in code
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == expected
