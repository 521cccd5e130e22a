"""README.md's training example and its `zephon` command lines, run as printed in a directory
of their own (the reader's repository checkout: examples/ copied there)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.zephon.doc_blocks import Block, block
from tests.zephon.doc_checks import _commands, clean_env, prepare

CATALOG = "sqlite:///runs/catalog.db"


@dataclass
class Workdir:
    path: Path
    runs: list[subprocess.CompletedProcess] = field(default_factory=list)


def train(path: Path) -> Workdir:
    """README block 5's three commands, one after another, in ``path``."""
    prepare(path)
    work = Workdir(path)
    for command in _commands(block("README.md", 5)):
        argv = shlex.split(command)
        assert argv[0] == "python", command
        work.runs.append(
            subprocess.run(
                [sys.executable, *argv[1:]],
                cwd=path,
                env=clean_env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
        )
    return work


def _bash(command: str, work: Workdir) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", command],
        cwd=work.path,
        env=clean_env(COLUMNS="80", PATH=f"{Path(sys.executable).parent}:{clean_env()['PATH']}"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def check_training(doc: Block, work: Workdir) -> None:
    """Every run exits 0; the second says it has nothing to do; the third continues to 60."""
    for run in work.runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert "Training is already complete, nothing to do" in work.runs[1].stderr
    assert "Training is already complete" not in work.runs[2].stderr


_CLI = """
import json, shlex, sys
from zephon.cli import main
codes = []
for line in json.loads(sys.argv[1]):
    try:
        codes.append(main(shlex.split(line)[1:]))
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps(codes))
"""


def check_commands(doc: Block, work: Workdir) -> None:
    """Every command line after the example ran, with the block's ``export``: the first in
    bash through the ``zephon`` script, the others through the same CLI entry point
    (``zephon.cli.main``) one after another in one interpreter, to save the start-up of each.
    Each exits 0 (the example has complete checkpoints, so ``zephon latest`` finds one); the
    stated exit 1 of ``zephon latest`` is checked on a run that has none."""
    commands = _commands(doc)
    setup, first, rest = commands[0], commands[1], commands[2:]
    assert setup == f"export ZEPHON_CATALOG_URL={CATALOG}"
    assert all(command.startswith("zephon ") for command in commands[1:]), commands
    done = _bash(f"{setup}; {first}", work)
    assert done.returncode == 0, f"{first}: exit {done.returncode}: {done.stderr}"
    # the exit code the block states: `zephon latest` exits 1 where there is no checkpoint
    assert "zephon latest example-run" in doc.code and "(exit 1: none)" in doc.code
    lines = [*rest, "zephon latest no-such-run"]
    expected = [0] * len(rest) + [1]
    done = _bash(f"{setup}; python -c {shlex.quote(_CLI)} {shlex.quote(json.dumps(lines))}", work)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.splitlines()[-1])
    failed = [
        (command, code, want)
        for command, code, want in zip(lines, codes, expected, strict=True)
        if code != want
    ]
    assert not failed, f"{failed}: {done.stderr[-3000:]}"


_VARIES = re.compile(r"\d+\.\d+ (?:B|KiB|MiB)|\d+\.\d+s|(?<=\s)\d+\.\d+(?=\s)")


def _normal(table: str) -> list[list[str]]:
    """The table's lines as words, with sizes, durations and rates (which vary) replaced."""
    return [_VARIES.sub("#", line).split() for line in table.strip("\n").splitlines()]


def compare_table(shown: str, real: str) -> None:
    """A table the page shows and the one the command printed: the same title (its directory
    aside), header and rows (sizes, durations and MB/s aside)."""
    got, want = _normal(real), _normal(shown)
    assert got[0][:-1] == want[0][:-1], (got[0], want[0])  # "checkpoints of run R in <dir>"
    if want[0][-1].startswith("/"):  # a local path: the reader's own directory
        assert got[0][-1].split("/")[-2:] == want[0][-1].split("/")[-2:]
    else:
        assert got[0][-1] == want[0][-1]
    assert got[1:] == want[1:], real


def check_table(doc: Block, work: Workdir) -> None:
    """The command shown, run after the example (on an 80-column terminal)."""
    command, *shown = doc.code.rstrip("\n").split("\n")
    assert command.startswith("$ zephon ")
    done = _bash(f"export ZEPHON_CATALOG_URL={CATALOG}; {command[2:]}", work)
    assert done.returncode == 0, done.stderr
    compare_table("\n".join(shown), done.stdout)


def check_cron(doc: Block) -> None:
    """Parsed only (it names a PostgreSQL host and an AWS profile of the reader's): five cron
    fields, environment assignments, the venv's ``zephon``, and arguments the zephon CLI
    parser accepts; the catalog URL is one the catalog accepts."""
    from zephon.catalog import mask_url
    from zephon.cli import build_parser

    words = shlex.split(doc.code)
    schedule, words = words[:5], words[5:]
    assert all(re.fullmatch(r"[\d*/,-]+", field_) for field_ in schedule), schedule
    env = {}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert env["ZEPHON_CATALOG_URL"].startswith("postgresql+psycopg://")
    mask_url(env["ZEPHON_CATALOG_URL"])
    assert words[0].endswith("/.venv/bin/zephon"), words[0]
    args = words[1 : words.index(">>")]
    parsed = build_parser().parse_args(args)
    assert parsed.command == "gc" and parsed.grace.total_seconds() == 24 * 3600


def check(doc: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if doc.number == 8:
        check_cron(doc)
        return
    work = request.getfixturevalue("readme_workdir")
    {5: check_training, 6: check_commands, 7: check_table}[doc.number](doc, work)
