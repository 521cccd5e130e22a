"""Every fenced block of README.md and docs/*.md is run or checked by one test of its own.

Blocks are found on every page (a glob, so a new page is covered at once) and dispatched by
kind:

- ``python``: run as printed in a process of its own (forked from an interpreter that has
  imported torch and nothing else: tests/zygote.py) in a temporary directory
  (PYTHONPATH = the repository); a block followed by "prints" and an output block must print
  exactly that. A
  block naming ``s3://`` runs against the moto server (endpoint and keys from the environment,
  as s3fs reads them) with the buckets it names created; one naming ``az://`` against Azurite
  (the connection string in ``AZURE_STORAGE_CONNECTION_STRING``), its containers created.
- ``yaml``: loaded with ``zephon.load_job_config``; README's is examples/job.yaml.
- ``bash``/``sh``, ``json``, ``sql``, ``cron`` and untyped output blocks: a checker of their
  own in ``CHECKS`` (tests/zephon/doc_checks.py), which says what it runs.
- ``text``: a figure (layout, state machine, message sequence); nothing to run, the paths it
  names are checked by tests/zephon/test_doc_paths.py.

Anything else fails; nothing is skipped. A block that cannot run here (docs/torchtitan.md's
8-GPU launch; its CPU run, which needs torchtitan's own environment) has a checker that checks
what it needs, or that the test which does run it reads it. A ``CHECKS`` entry that no longer
names the block it was written for fails too.
"""

from __future__ import annotations

import glob
import os

import pytest

from tests.zephon import doc_checks
from tests.zephon.doc_blocks import REPO, Block, all_blocks, block, output_of, parse

BLOCKS = all_blocks()

#: (page, block number) -> (the start of the block's first line, the checker)
CHECKS = doc_checks.CHECKS


@pytest.fixture(scope="module")
def readme_workdir(tmp_path_factory):
    """README's training example, run once for the blocks that use its checkpoints."""
    from tests.zephon.doc_readme import train

    return train(tmp_path_factory.mktemp("readme"))


def _key(b: Block) -> tuple[str, int]:
    return (b.page, b.number)


@pytest.mark.parametrize("doc", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(doc: Block, request: pytest.FixtureRequest, tmp_path) -> None:
    key = _key(doc)
    if key in CHECKS:
        CHECKS[key][1](doc, request, tmp_path)
        return
    if doc.output_of is not None:
        shown = block(doc.page, doc.output_of)
        assert _key(shown) in CHECKS or shown.lang == "python", (
            f"{doc.id} is shown as the output of {shown.id}, which nothing runs"
        )
        return  # compared by the test of the block that prints it
    if doc.lang == "python":
        doc_checks.run_python(doc, request, tmp_path)
    elif doc.lang == "yaml":
        doc_checks.load_yaml(doc, tmp_path)
    elif doc.lang == "text":
        assert output_of(doc) is None, f"{doc.id}: a figure has no output"
    else:
        pytest.fail(
            f"{doc.id} (```{doc.lang}, line {doc.line}) is run by nothing: give it a checker in "
            "tests/zephon/doc_checks.py CHECKS (which may check what a block needs when the block "
            "itself cannot run here, as for docs/torchtitan.md's 8-GPU launch)",
            pytrace=False,
        )


def test_every_listed_block_still_exists():
    by_key = {_key(b): b for b in BLOCKS}
    for key, (first_line, *_rest) in CHECKS.items():
        assert key in by_key, f"CHECKS names {key}, which is no block any more"
        assert by_key[key].first_line.startswith(first_line), (
            f"CHECKS entry {key} was written for a block starting {first_line!r}; that block "
            f"now starts {by_key[key].first_line!r}: renumber the entry"
        )


def test_every_example_program_is_run_by_a_block():
    """examples/*.py run as README's blocks 5 (training) and 9 (pipeline) print them."""
    run = block("README.md", 5).code + block("README.md", 9).code
    for path in sorted(glob.glob(os.path.join(REPO, "examples", "*.py"))):
        name = f"examples/{os.path.basename(path)}"
        assert f"python {name}" in run, f"{name} is run by no block of README.md"


def test_the_parser_numbers_blocks_and_finds_shown_output():
    text = (
        "Intro.\n\n```python\nprint(1)\n```\n\nprints\n\n```\n1\n```\n\n"
        "A figure:\n\n```text\na -> b\n```\n\n`x.py` prints on rank 0\n\n```\n2\n```\n"
    )
    found = parse("p.md", text)
    assert [(b.number, b.lang, b.code, b.output_of) for b in found] == [
        (1, "python", "print(1)\n", None),
        (2, "", "1\n", 1),
        (3, "text", "a -> b\n", None),
        (4, "", "2\n", 3),
    ]
    assert found[0].line == 3 and found[0].id == "p.md#1"


def test_a_block_of_a_kind_nothing_runs_fails(request, tmp_path):
    unknown = Block(page="p.md", number=1, lang="toml", code="a = 1\n", line=1, lead="")
    with pytest.raises(pytest.fail.Exception, match="is run by nothing"):
        test_block(unknown, request, tmp_path)
