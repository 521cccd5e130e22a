"""docs/multinode.md's printed example runs as printed, through the runner of
tests/zephon/test_docs.py (imported as a module, so pytest does not collect its tests again)."""

from __future__ import annotations

from tests.zephon import test_docs as runner


def test_the_multinode_page_prints_what_it_says(tmp_path):
    assert runner.examples("docs/multinode.md"), "docs/multinode.md has no printed example"
    runner.test_every_printed_example_prints_what_the_page_says("docs/multinode.md", tmp_path)
