"""docs/pipeline.md "Code written for the Zephon data library": every example prints what the page
says it prints (int shard ids, exhausted_policy, MixtureSpec, from_path keywords)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.zephon.test_docs import _EXAMPLE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
DOC = os.path.join(ROOT, "docs", "pipeline.md")
SECTION = "## Code written for the Zephon data library"


def _section_examples() -> list[tuple[str, str]]:
    with open(DOC, encoding="utf-8") as handle:
        text = handle.read()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end != -1 else len(text)]
    return [(m.group("code"), m.group("out")) for m in _EXAMPLE.finditer(section)]


EXAMPLES = _section_examples()


def test_the_section_has_an_example_for_each_feature():
    code = "\n".join(c for c, _ in EXAMPLES)
    assert len(EXAMPLES) == 4
    for feature in (
        "{k: zephon.InMemoryShard",
        'exhausted_policy="repeat"',
        "MixtureSpec(",
        "fmt=",
    ):
        assert feature in code


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_each_example_prints_what_the_page_says(index, tmp_path):
    code, expected = EXAMPLES[index]
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == expected
