"""Every printed example in docs/ runs as printed: each ``python`` block followed by "prints" and
an output block must print exactly that output, in a fresh interpreter. The one runner for every
page (docs/pipeline.md's quick start and state table are also checked by
tests/zephon/pipeline/test_docs.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a python block (no other block inside it) followed by "prints" and its output block
_EXAMPLE = re.compile(
    r"```python\n(?P<code>(?:(?!```).)*?)```\n\nprints\n\n```\n(?P<out>.*?)```", re.S
)


def examples(page: str) -> list[tuple[str, str]]:
    with open(os.path.join(REPO, page)) as handle:
        text = handle.read()
    return [(m.group("code"), m.group("out")) for m in _EXAMPLE.finditer(text)]


PAGES = [
    "docs/fencing.md",
    "docs/dcp.md",
    "docs/huggingface.md",
    "docs/lightning.md",
    "docs/multinode.md",
    "docs/pipeline.md",
    "docs/tiers.md",
]


@pytest.mark.parametrize("page", PAGES)
def test_every_printed_example_prints_what_the_page_says(page, tmp_path):
    found = examples(page)
    assert found, f"{page} has no example with printed output"
    for code, expected in found:
        script = tmp_path / "example.py"
        script.write_text(code)
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": REPO},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout == expected
