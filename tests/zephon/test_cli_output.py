"""What ``zephon`` prints for people: tables that stay readable in an 80-column terminal
(``--wide`` for every value whole), which checkpoints are listed, text from storage printed
literally, and exported files shared like any other output."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from rich.console import Console

from tests.conftest import Backend
from tests.zephon.saves import crash_before_marker, save_step, start
from tests.zephon.test_composition import make_run
from zephon.cli import render
from zephon.cli.render import Column, shorten

LONG_RUN = "llama-70b-pretrain-cosine-lr3e-4-seq8192-warmup2000-run-2024-11-03"
BIG_STEP = 123_456_789_012


@pytest.fixture
def narrow(monkeypatch):
    """Output through a Console 80 columns wide, as a terminal of that size would get it."""
    monkeypatch.setattr(render, "console", Console(width=80, **CONSOLE))


CONSOLE = {"highlight": False, "soft_wrap": True, "markup": False, "emoji": False}


@pytest.fixture
def deep_storage(tmp_path) -> Backend:
    """A storage root deep enough that its URL alone is wider than the terminal."""
    return Backend("local", str(tmp_path / "team" / "experiments" / ("x" * 40) / "checkpoints"))


@pytest.fixture
def wide_world(catalog, deep_storage):
    """Two runs, one with a long name, checkpoints up to a 12-digit step."""
    for name in (LONG_RUN, "r"):
        location = make_run(catalog, deep_storage, name=name, num_to_keep=3)
        attempt = start(location, catalog)
        for step in (10, 20, BIG_STEP):
            save_step(attempt, step, catalog)
    return deep_storage


def lines_of(out: str) -> list[str]:
    return out.rstrip("\n").split("\n")


def test_runs_fit_80_columns_one_line_a_run(cli, narrow, wide_world):
    code, out, _ = cli("runs")
    title, header, *rows = lines_of(out)
    assert code == 0 and len(rows) == 2  # one line a run: nothing wraps
    assert all(len(line) <= 80 for line in (title, header, *rows)), out
    # kind is the detail that gives way first (--wide shows it), so the stall still fits
    assert header.split() == [
        "run",
        "status",
        "ckpts",
        "size",
        "latest",
        "pending",
        "keep",
        "stall",
        "storage",
    ]
    long_row = next(row for row in rows if row.startswith("llama"))
    assert str(BIG_STEP) in long_row.split()  # numbers whole
    assert "…" in long_row and LONG_RUN not in long_row  # long text shortened in the middle
    name, storage = long_row.split()[0], long_row.split()[-1]
    for shown, whole in ((name, LONG_RUN), (storage, wide_world.url)):
        head, tail = shown.split("…")  # cut in the middle: both ends kept
        assert whole.startswith(head) and whole.endswith(tail) and head and tail


def test_wide_prints_every_value_whole(cli, narrow, wide_world):
    code, out, _ = cli("runs", "--wide")
    assert code == 0 and LONG_RUN in out and wide_world.url in out and "…" not in out
    assert len(lines_of(out)) == 4  # still one line a run, however long
    assert lines_of(out)[1].split() == [
        "run", "kind", "status", "ckpts", "size", "latest", "pending", "keep", "stall", "storage",
    ]  # fmt: skip
    code, out, _ = cli("checkpoints", LONG_RUN, "--wide")
    assert code == 0 and f"{LONG_RUN}/save-{BIG_STEP}" in out and wide_world.url in out
    assert "+00:00" in out  # the full timestamp


def test_checkpoints_show_paths_relative_to_the_runs_storage(cli, narrow, wide_world):
    code, out, _ = cli("checkpoints", "r")
    title, header, *rows = lines_of(out)
    assert code == 0 and len(rows) == 3 and all(len(line) <= 80 for line in lines_of(out))
    assert title.startswith("checkpoints of run r in /") and "…" in title
    assert [row.split()[0] for row in rows] == ["10", "20", str(BIG_STEP)]
    assert rows[0].split()[-1] == "r/save-10"  # relative to the run's storage URL
    assert wide_world.url not in out


def test_the_installed_command_fits_the_terminal_it_is_told(catalog_url, wide_world):
    env = {**os.environ, "COLUMNS": "80", "ZEPHON_CATALOG_URL": catalog_url}
    zephon = os.path.join(os.path.dirname(sys.executable), "zephon")
    done = subprocess.run([zephon, "runs"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and len(lines_of(done.stdout)) == 4
    assert all(len(line) <= 80 for line in lines_of(done.stdout)), done.stdout


def test_numbers_are_never_cut_even_when_the_terminal_is_too_narrow(monkeypatch, capsys):
    monkeypatch.setattr(render, "console", Console(width=20, **CONSOLE))
    render.print_table(
        "t", [Column("step", numeric=True), Column("path", flex=True)], [(BIG_STEP, "a" * 50)]
    )
    row = lines_of(capsys.readouterr().out)[-1]
    assert row.split()[0] == str(BIG_STEP) and "…" in row


@pytest.mark.parametrize(
    ("text", "width", "expected"),
    [
        ("s3://bucket/a/b/c/run", 17, "s3://bucket/…/run"),
        ("s3://bucket/a/b/c/run", 21, "s3://bucket/a/b/c/run"),
        ("/data/team/experiments/checkpoints/run", 24, "/data/…/checkpoints/run"),
        ("llama-70b-pretrain-cosine", 11, "llama…osine"),
        ("abc", 1, "…"),
    ],
)
def test_long_values_are_shortened_in_the_middle(text, width, expected):
    assert shorten(text, width) == expected
    assert len(shorten(text, width)) <= width


def test_text_from_storage_is_printed_literally(cli, catalog, tmp_path, narrow):
    # rich markup and a terminal escape in a storage path: printed as they are, escaped
    hostile = Backend("local", str(tmp_path / "[bold]x[/]" / "\x1b[2Jckpt"))
    make_run(catalog, hostile, name="odd")
    code, out, err = cli("runs", "--wide")
    assert (code, err) == (0, "")
    assert "[bold]x[/]" in out and "\\x1b[2Jckpt" in out and "\x1b" not in out


# -- which checkpoints are listed --------------------------------------------------------------


@pytest.fixture
def every_state(catalog, local_backend, cli):
    """Run r with a deleted (10), committed (20, 30) and failed (40) checkpoint."""
    location = make_run(catalog, local_backend, num_to_keep=2)
    attempt = start(location, catalog)
    for step in (10, 20, 30):
        save_step(attempt, step, catalog)
    crash_before_marker(attempt, catalog, 40)
    code, _, _ = cli("gc", "--pending-grace", "0")
    assert code == 0
    return location


def test_checkpoints_lists_live_ones_by_default_and_all_with_all(cli, every_state):
    code, out, _ = cli("checkpoints", "r", "--json")
    assert code == 0
    assert [(c["step"], c["state"]) for c in json.loads(out)] == [
        (20, "committed"),
        (30, "committed"),
        (40, "failed"),
    ]
    code, out, _ = cli("checkpoints", "r", "--all", "--json")
    assert [(c["step"], c["state"]) for c in json.loads(out)][0] == (10, "deleted")
    code, out, _ = cli("checkpoints", "r")
    assert "deleted" not in out and "failed" in out
    code, out, _ = cli("checkpoints", "r", "--state", "deleted", "--json")
    assert [c["step"] for c in json.loads(out)] == [10]


@pytest.mark.parametrize("state", ["corrupt", "stale"])
def test_every_state_can_be_asked_for(cli, every_state, state):
    code, out, _ = cli("checkpoints", "r", "--state", state, "--json")
    assert code == 0 and json.loads(out) == []


def test_state_and_all_exclude_each_other(cli, every_state):
    code, _, err = cli("checkpoints", "r", "--all", "--state", "failed")
    assert code == 2 and "not allowed with argument" in err and err.count("\n") == 1


# -- export ------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_get_the_permissions_of_any_new_file(cli, catalog_url, tmp_path, umask):
    import torch

    from zephon.checkpointing import CheckpointManager
    from zephon.config import CheckpointingConfig

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    config = CheckpointingConfig(save_dir=str(tmp_path / "ckpt"), catalog_url=catalog_url)
    with CheckpointManager(config, run_name="m", total_steps=5) as manager:
        manager.save(5, {"model": model})
    previous = os.umask(umask)
    try:
        for name, size in (("one", "5GB"), ("sharded", "1000")):
            out = tmp_path / name
            code, stdout, _ = cli("export", "m", "--out", str(out), "--max-shard-size", size)
            assert code == 0, stdout
            modes = {f: stat.S_IMODE(os.stat(out / f).st_mode) for f in os.listdir(out)}
            assert len(modes) == (2 if name == "one" else 5)
            assert set(modes.values()) == {0o666 & ~umask}, modes
    finally:
        os.umask(previous)
