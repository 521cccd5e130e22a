"""The documentation stands alone: every relative link of README.md and docs/*.md leads to a
file (and heading) of the repository, every repository path named in backticks exists (a
``path::name`` also names something in that file), and nothing points outside the
repository (a design file, "seed 002", ``../shared``)."""

from __future__ import annotations

import os
import re

import pytest

from tests.zephon.doc_blocks import REPO, pages

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_TOP = ("zephon", "storage", "catalog", "tests", "benchmarks", "examples", "docs", "migrations")
_REPO_PATH = re.compile(
    rf"^(?:{'|'.join(_TOP)}|\.ci)/[A-Za-z0-9_./-]*(?:::[A-Za-z0-9_]+)?$|^\.ci/[a-z]+$"
)
#: what a page written for this repository alone never says
_OUTSIDE = re.compile(r"\bseed \d{3}\b|\.\./shared\b|/work/|/tmp/h/", re.I)


def _prose(page: str) -> str:
    """The page without its fenced blocks (paths in examples are the examples' own)."""
    with open(os.path.join(REPO, page), encoding="utf-8") as handle:
        text = handle.read()
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as handle:
        text = re.sub(r"^```.*?^```", "", handle.read(), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", pages())
def test_every_relative_link_leads_to_a_file_and_heading(page):
    base = os.path.dirname(os.path.join(REPO, page))
    for target in _LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(REPO, page)
        assert full.startswith(REPO + os.sep), f"{page}: {target} points outside the repository"
        assert os.path.exists(full), f"{page}: {target} does not exist"
        if anchor and full.endswith(".md"):
            assert anchor in _anchors(full), f"{page}: {target}: no heading #{anchor}"


@pytest.mark.parametrize("page", pages())
def test_every_repository_path_named_exists(page):
    spans = _CODE_SPAN.findall(_prose(page))
    # a command's script counts too: `python benchmarks/x.py --flag`
    spans += [span.split()[1] for span in spans if re.match(r"python3? [\w./-]+\.py\b", span)]
    named = [span for span in spans if _REPO_PATH.match(span)]
    for span in named:
        path, _, name = span.partition("::")
        full = os.path.join(REPO, path)
        assert os.path.exists(full), f"{page}: `{span}` does not exist"
        if name:
            with open(full, encoding="utf-8") as handle:
                assert re.search(rf"\b(def|class) {name}\b", handle.read()), (
                    f"{page}: `{span}`: {path} has no {name}"
                )


@pytest.mark.parametrize("page", [*pages(), "examples/job.yaml"])
def test_nothing_points_outside_the_repository(page):
    with open(os.path.join(REPO, page), encoding="utf-8") as handle:
        found = _OUTSIDE.findall(handle.read())
    assert not found, f"{page} refers to something outside the repository: {found}"


def test_the_path_rules_catch_what_they_are_for():
    assert _REPO_PATH.match("zephon/saving.py") and _REPO_PATH.match("benchmarks/x.py")
    assert _REPO_PATH.match("tests/catalog/test_schema.py::test_x") and _REPO_PATH.match(".ci/run")
    assert not _REPO_PATH.match("s3://bucket/ckpt") and not _REPO_PATH.match("<save_dir>/x")
    assert _OUTSIDE.search("in the shape of seed 002") and _OUTSIDE.search("see ../shared/x")
    assert _slug("Timings and replicas") == "timings-and-replicas"
    assert _slug("Drop-in writer and reader") == "drop-in-writer-and-reader"
