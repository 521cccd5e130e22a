"""``zephon checkpoints`` and ``zephon runs`` show what a save took and where its copies are:
duration, MB/s and tiers per checkpoint, the latest save's stall per run, ``-`` for rows
nobody timed, everything in ``--json``; tables still fit 80 columns."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from sqlalchemy import create_engine, update

from tests.zephon.saves import save_step, start
from tests.zephon.test_composition import make_run
from zephon.catalog import CheckpointRecord
from zephon.catalog.models import Checkpoint
from zephon.cli import render, timing
from zephon.cli.render import human_rate, human_seconds

CONSOLE = {"highlight": False, "soft_wrap": True, "markup": False, "emoji": False}
MB = 1_000_000


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setattr(render, "console", Console(width=80, **CONSOLE))


def _commit(catalog, step, *, size=10 * MB, timings=None):
    row = catalog.begin_checkpoint("r", step, f"/c/r/save-{step}")
    catalog.mark_committed(
        "r", step, row.save_id, bytes=size, file_count=2, manifest_checksum=None, timings=timings
    )
    return row.save_id


def _replica(catalog, step, save_id, tier, state, reason="disk full"):
    host = "node-1" if tier == "local" else ""
    catalog.replica_started(
        "r", step, tier=tier, host=host, location=f"/t/{tier}/r/save-{step}", save_id=save_id
    )
    if state == "committed":
        catalog.replica_committed("r", step, tier=tier, host=host, save_id=save_id, bytes=1)
    elif state == "failed":
        catalog.replica_failed("r", step, tier=tier, host=host, save_id=save_id, reason=reason)


@pytest.fixture
def tiered(catalog):
    """Run ``r``: step 1 untimed (an old row), 2 timed and on save_dir only, 3 on local with
    its upload pending, 4 uploaded (both tiers), 5 on local with its upload failed, 6 timed
    as local + upload only."""
    catalog.ensure_run("r", "/c")
    _commit(catalog, 1)
    _commit(catalog, 2, timings={"write_s": 1.5, "commit_s": 0.5, "total_s": 2.5, "stall_s": 0.25})
    for step, upload in ((3, "pending"), (4, "committed"), (5, "failed")):
        save_id = _commit(catalog, step, timings={"local_s": 1.0})
        _replica(catalog, step, save_id, "local", "committed")
        _replica(catalog, step, save_id, "save_dir", upload)
    _commit(catalog, 6, timings={"local_s": 2.0, "upload_s": 70.0, "stall_s": 0.125})
    return catalog


def _rows(out: str) -> dict[int, dict[str, str]]:
    """Table rows by step and header: columns are the spans that are not blank on every line
    (cells may be empty, so splitting on spaces would not do)."""
    _, *lines = out.rstrip("\n").split("\n")
    width = max(len(line) for line in lines)
    padded = [line.ljust(width) for line in lines]
    used = [any(line[i] != " " for line in padded) for i in range(width)]
    spans, start = [], None
    for i, busy in enumerate([*used, False]):
        if busy and start is None:
            start = i
        elif not busy and start is not None and not any(used[i : i + 1]):
            # a single blank inside a value ("committed (UTC)") is not a gap
            if i + 1 < width and used[i + 1]:
                continue
            spans.append((start, i))
            start = None
    header, *rows = padded
    names = [header[a:b].strip() for a, b in spans]
    return {
        int(row[spans[0][0] : spans[0][1]]): {
            name: row[a:b].strip() for name, (a, b) in zip(names, spans, strict=True)
        }
        for row in rows
    }


def test_checkpoints_show_duration_rate_and_tiers(cli, tiered, narrow):
    code, out, err = cli("checkpoints", "r")
    assert (code, err) == (0, "")
    assert all(len(line) <= 80 for line in out.splitlines()), out
    rows = _rows(out)
    shown = {s: (r["duration"], r["MB/s"], r["tiers"]) for s, r in rows.items()}
    assert shown == {
        1: ("-", "-", "save_dir"),
        2: ("2.50s", "5.00", "save_dir"),  # 10 MB in write_s + commit_s = 2 s
        3: ("-", "-", "local (upload pending)"),
        4: ("-", "-", "local, save_dir"),
        5: ("-", "-", "local (upload failed)"),
        6: ("1m12s", "-", "save_dir"),  # local_s + upload_s
    }


def test_checkpoints_json_has_timings_and_replicas(cli, tiered):
    code, out, _ = cli("checkpoints", "r", "--json")
    assert code == 0
    by_step = {c["step"]: c for c in json.loads(out)}
    assert by_step[1]["timings"] is None and by_step[1]["replicas"] == []
    assert by_step[2]["timings"] == {
        "write_s": 1.5,
        "commit_s": 0.5,
        "total_s": 2.5,
        "stall_s": 0.25,
    }
    replicas = by_step[5]["replicas"]
    assert [(r["tier"], r["host"], r["state"]) for r in replicas] == [
        ("local", "node-1", "committed"),
        ("save_dir", "", "failed"),
    ]
    assert replicas[1]["failure_reason"] == "disk full"
    assert replicas[0]["location"] == "/t/local/r/save-5"


@pytest.fixture
def local_only(tiered):
    """Beside ``tiered``: step 7 committed on a local disk and step 8 being saved there, both
    without a checkpoint row (their uploads never began), and step 9 a local copy since
    deleted."""
    _replica(tiered, 7, "local-7", "local", "committed")
    _replica(tiered, 8, "local-8", "local", "pending")
    _replica(tiered, 9, "local-9", "local", "committed")
    tiered.replica_deleted("r", 9, tier="local", host="node-1")
    return tiered


def test_steps_only_a_local_tier_holds_are_listed_in_order(cli, local_only):
    code, out, err = cli("checkpoints", "r", "--wide")
    assert (code, err) == (0, "")
    rows = _rows(out)
    assert list(rows) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (rows[7]["state"], rows[7]["tiers"], rows[7]["path"]) == (
        "local only",
        "local (upload not begun)",
        "/t/local/r/save-7",
    )
    assert rows[7]["committed (UTC)"] != ""
    assert (rows[8]["state"], rows[8]["tiers"]) == ("local only", "local (saving)")

    code, out, _ = cli("checkpoints", "r", "--json")
    by_step = {c["step"]: c for c in json.loads(out)}
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert by_step[7]["state"] == "local only"
    assert [(r["tier"], r["state"]) for r in by_step[7]["replicas"]] == [("local", "committed")]

    code, out, _ = cli("checkpoints", "r", "--state", "committed", "--json")
    assert 7 not in {c["step"] for c in json.loads(out)}  # not a checkpoint state
    code, out, _ = cli("checkpoints", "r", "--all", "--json")
    assert {7, 8} <= {c["step"] for c in json.loads(out)} and 9 not in {
        c["step"] for c in json.loads(out)
    }


def test_runs_show_the_latest_saves_stall(cli, tiered, narrow):
    tiered.ensure_run("quiet", "/c")
    code, out, _ = cli("runs")
    assert code == 0 and all(len(line) <= 80 for line in out.splitlines()), out
    _, header, *rows = out.rstrip("\n").split("\n")
    assert "stall" in header.split()
    stalls = {row.split()[0]: row.split()[-2] for row in rows}
    assert stalls == {"quiet": "-", "r": "0.12s"}  # step 6 is the latest committed
    code, out, _ = cli("runs", "--json")
    by_name = {r["name"]: r for r in json.loads(out)}
    assert by_name["r"]["latest_timings"] == {"local_s": 2.0, "upload_s": 70.0, "stall_s": 0.125}
    assert by_name["quiet"]["latest_timings"] is None


def test_a_real_save_is_timed_and_its_rate_shown(cli, catalog, local_backend, narrow):
    location = make_run(catalog, local_backend)
    save_step(start(location, catalog), 10, catalog, files={"w.bin": b"x" * 200_000})
    code, out, _ = cli("checkpoints", "r")
    row = _rows(out)[10]
    assert row["duration"].endswith("s") and row["duration"] != "-"
    assert float(row["MB/s"]) > 0
    assert row["tiers"] == "save_dir"


def test_details_give_way_to_the_new_columns_on_a_narrow_terminal(cli, tiered, monkeypatch):
    monkeypatch.setattr(render, "console", Console(width=200, **CONSOLE))
    code, out, _ = cli("checkpoints", "r")
    header = out.split("\n")[1]
    for name in ("epoch", "files", "pin", "committed (UTC)", "duration", "MB/s", "tiers"):
        assert name in header
    monkeypatch.setattr(render, "console", Console(width=80, **CONSOLE))
    code, out, _ = cli("checkpoints", "r")
    header = out.split("\n")[1]
    assert "files" not in header and "epoch" not in header
    assert all(name in header for name in ("step", "size", "duration", "MB/s", "tiers", "path"))
    code, out, _ = cli("checkpoints", "r", "--wide")
    assert "files" in out.split("\n")[1] and "local (upload pending)" in out


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(None, "-"), (0.0, "0.00s"), (0.004, "0.00s"), (9.994, "9.99s"), (12.34, "12.3s"),
     (59.96, "60.0s"), (61.0, "1m01s"), (3599.0, "59m59s"), (3600.0, "1h00m"),
     (90061.0, "25h01m")],
)  # fmt: skip
def test_seconds_are_shown_short(seconds, shown):
    assert human_seconds(seconds) == shown


@pytest.mark.parametrize(
    ("size", "seconds", "shown"),
    [(None, 1.0, "-"), (5, None, "-"), (5, 0.0, "-"), (5 * MB, 2.0, "2.50"),
     (25 * MB, 2.0, "12.5"), (3 * 10**9, 2.0, "1500"), (0, 1.0, "0.00")],
)  # fmt: skip
def test_rates_are_megabytes_per_second(size, seconds, shown):
    assert human_rate(size, seconds) == shown


def test_duration_is_total_or_local_plus_upload():
    assert timing.duration_s(None) is None
    assert timing.duration_s({"write_s": 1.0}) is None
    assert timing.duration_s({"local_s": 1.0}) is None
    assert timing.duration_s({"local_s": 1.0, "upload_s": 2.0}) == 3.0
    assert timing.duration_s({"total_s": 5.0, "local_s": 1.0, "upload_s": 2.0}) == 5.0
    assert timing.rate(MB, {"write_s": 1.0}) == "-"


def test_only_live_checkpoints_have_tiers():
    base = CheckpointRecord.__dataclass_fields__
    values = {name: None for name in base}
    for state, shown in (("deleted", "-"), ("failed", "-"), ("pending", "-"), ("stale", "-")):
        record = CheckpointRecord(**{**values, "state": state})
        assert timing.tiers(record, []) == shown


def _hand_edit_timings(catalog_url: str, step: int, timings: object) -> None:
    """Store ``timings`` in step ``step``'s row as a hand edit or another tool would: past the
    catalog's checks of what a save records."""
    engine = create_engine(catalog_url)
    try:
        with engine.begin() as connection:
            connection.execute(
                update(Checkpoint).where(Checkpoint.step == step).values(timings=timings)
            )
    finally:
        engine.dispose()


def test_timings_that_are_not_numbers_show_as_unknown(cli, tiered, catalog_url, narrow):
    _hand_edit_timings(
        catalog_url,
        2,
        {"write_s": "fast", "commit_s": None, "total_s": [1], "stall_s": "0.5", "local_s": True},
    )
    _hand_edit_timings(catalog_url, 6, {"local_s": {"x": 1}, "upload_s": -3, "stall_s": "slow"})
    _hand_edit_timings(catalog_url, 4, ["not", "a", "mapping"])
    code, out, err = cli("checkpoints", "r")
    assert code == 0, err
    rows = _rows(out)
    for step in (2, 4, 6):
        assert (rows[step]["duration"], rows[step]["MB/s"]) == ("-", "-")
    code, out, err = cli("runs")
    assert code == 0, err
    assert out.rstrip("\n").split("\n")[-1].split()[-2] == "-"  # run r's latest: step 6
    code, out, err = cli("checkpoints", "r", "--json")
    assert code == 0, err
    assert {c["step"]: c["timings"] for c in json.loads(out)}[4] == ["not", "a", "mapping"]
