"""The fenced code blocks of README.md and docs/*.md, for the tests that run them.

A block is numbered by its position on its page (1-based). A block whose preceding prose is
"prints" (the whole paragraph, or a sentence ending in it, e.g. "`torchrun ...` prints on rank
0") is the *output* of the block before it, and is checked with that block.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FENCE = re.compile(r"^```(?P<lang>[^\n`]*)\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository, e.g. "docs/catalog.md"
    number: int  # 1-based position on the page
    lang: str  # the fence's info string; "" for an untyped block
    code: str
    line: int  # the line of the opening fence
    lead: str  # the last line of prose before the block
    output_of: int | None = None  # the number of the block this one is the printed output of

    @property
    def id(self) -> str:
        return f"{self.page}#{self.number}"

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0]


def pages() -> list[str]:
    """Every page of documentation, found by glob so that a new page is covered at once."""
    found = ["README.md"] + sorted(
        os.path.relpath(path, REPO) for path in glob.glob(os.path.join(REPO, "docs", "*.md"))
    )
    return found


def page_blocks(page: str) -> list[Block]:
    with open(os.path.join(REPO, page), encoding="utf-8") as handle:
        return parse(page, handle.read())


def parse(page: str, text: str) -> list[Block]:
    """The fenced blocks of ``text`` (the page ``page``), in order."""
    blocks: list[Block] = []
    end = 0
    for number, match in enumerate(_FENCE.finditer(text), start=1):
        between = text[end : match.start()].strip()
        lead = between.split("\n")[-1] if between else ""
        output_of = number - 1 if blocks and re.search(r"\bprints\b[^.]*$", lead) else None
        if output_of is not None and between.count("\n") > 3 and lead.strip() != "prints":
            output_of = None  # a long paragraph ending in "prints" describes, it does not show
        blocks.append(
            Block(
                page=page,
                number=number,
                lang=match.group("lang").strip(),
                code=match.group("code"),
                line=text.count("\n", 0, match.start()) + 1,
                lead=lead,
                output_of=output_of,
            )
        )
        end = match.end()
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in page_blocks(page)]


def block(page: str, number: int) -> Block:
    return page_blocks(page)[number - 1]


def output_of(target: Block) -> Block | None:
    """The block printed right after ``target`` (its shown output), if any."""
    following = page_blocks(target.page)[target.number :]
    if following and following[0].output_of == target.number:
        return following[0]
    return None
