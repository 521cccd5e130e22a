"""README's "The `zephon` command" section, run as printed: after the training example, every
command in its block exits 0, as does the gc of its crontab line."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from zephon.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def section() -> str:
    with open(os.path.join(REPO, "README.md")) as handle:
        text = handle.read()
    start = text.index("## The `zephon` command")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def commands() -> list[str]:
    """The lines of the section's bash block, comments removed."""
    (block,) = re.findall(r"```bash\n(.*?)```", section(), re.S)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_section_documents_the_flags_and_exit_codes():
    text = section()
    for flag in ("--wide", "--all", "--state", "--json", "--storage-options", "--catalog"):
        assert flag in text
    for code in ("1 nothing found", "2 bad usage", "3 problems found", "4 storage error"):
        assert code in " ".join(text.split())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``examples/train.py examples/job.yaml --total-steps 60`` in a directory of its own."""
    work = tmp_path_factory.mktemp("readme")
    shutil.copy(os.path.join(REPO, "examples", "job.yaml"), work / "job.yaml")
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "train.py"), "job.yaml"]
        + ["--total-steps", "60"],
        cwd=work,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return work


def test_every_command_of_the_section_works_as_printed(trained, monkeypatch, capsys):
    monkeypatch.chdir(trained)
    monkeypatch.delenv("ZEPHON_STORAGE_OPTIONS", raising=False)
    ran = []
    for line in commands():
        argv = shlex.split(line)
        if argv[0] == "export" and "=" in argv[1]:
            name, value = argv[1].split("=", 1)
            monkeypatch.setenv(name, value)
            continue
        assert argv[0] == "zephon", line
        code = main(argv[1:])
        out, err = capsys.readouterr()
        assert (code, err) == (0, ""), (line, out, err)
        ran.append(argv[1])
    assert {"runs", "checkpoints", "latest", "verify", "pin", "gc", "export", "sync"} <= set(ran)
    assert os.path.exists(trained / "runs" / "export" / "model.safetensors")


def test_the_crontab_lines_gc_works_as_printed(trained, monkeypatch, capsys):
    (line,) = re.findall(r"```cron\n(.*?)\n```", section(), re.S)
    argv = shlex.split(line.split(" >>")[0])
    zephon = next(i for i, word in enumerate(argv) if word.endswith("/bin/zephon"))
    monkeypatch.setenv("ZEPHON_CATALOG_URL", f"sqlite:///{trained / 'runs' / 'catalog.db'}")
    assert main(argv[zephon + 1 :]) == 0
    assert "gc: " in capsys.readouterr().out
