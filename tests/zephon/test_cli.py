"""The ``zephon`` command: every subcommand, JSON output, exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.zephon.saves import crash_after_marker, save_step, start
from tests.zephon.test_composition import make_run
from zephon.catalog import Catalog
from zephon.cli import main


@pytest.fixture
def populated(catalog, local_backend):
    location = make_run(catalog, local_backend, num_to_keep=2)
    attempt = start(location, catalog)
    for step in (10, 20, 30):
        save_step(attempt, step, catalog)
    return location


def test_runs_lists_runs_as_json_and_table(cli, populated):
    code, out, _ = cli("runs", "--json")
    assert code == 0
    (run,) = json.loads(out)
    assert (run["name"], run["committed_count"], run["latest_step"]) == ("r", 3, 30)
    code, out, _ = cli("runs")
    assert code == 0 and "r" in out and "train" in out


def test_checkpoints_lists_steps_and_filters_states(cli, populated):
    code, out, _ = cli("checkpoints", "r", "--json")
    assert code == 0 and [c["step"] for c in json.loads(out)] == [10, 20, 30]
    code, out, _ = cli("checkpoints", "r", "--state", "failed", "--json")
    assert json.loads(out) == []


def test_latest_prints_the_url_and_repairs_a_crash(cli, catalog, populated):
    crash_after_marker(start(populated, catalog, resumed_from=30), catalog, 40)
    code, out, _ = cli("latest", "r")
    assert code == 0 and out.strip() == populated.checkpoint_url(40)
    code, out, _ = cli("latest", "r", "--json")
    assert json.loads(out)["step"] == 40


def test_latest_answers_from_the_catalog_and_check_reads_the_marker(cli, catalog, populated):
    os.remove(populated.runstore.marker_path(30))  # gone behind the catalog's back
    code, out, _ = cli("latest", "r")  # the catalog's answer: no storage request
    assert code == 0 and out.strip() == populated.checkpoint_url(30)
    code, out, _ = cli("latest", "r", "--check")  # reads the marker: 30 is set aside
    assert code == 0 and out.strip() == populated.checkpoint_url(20)
    assert catalog.get_checkpoint("r", 30).state == "deleted"
    assert cli("latest", "r")[1].strip() == populated.checkpoint_url(20)


def test_latest_exits_1_when_there_is_none(cli, catalog, local_backend):
    make_run(catalog, local_backend, name="empty")
    code, out, _ = cli("latest", "empty")
    assert code == 1 and "no complete checkpoint" in out


def test_latest_and_verify_work_without_a_catalog(cli, populated, local_backend):
    code, out, _ = cli("latest", "r", "--save-dir", local_backend.url)
    assert code == 0 and out.strip().endswith("r/save-30")
    code, out, _ = cli("verify", "r", "--save-dir", local_backend.url, "--deep", "--json")
    assert code == 0 and json.loads(out)["ok"] is True


def test_verify_names_every_bad_file_and_exits_3(cli, populated):
    path = populated.store.run("r").reader(20).path
    with open(f"{path}/w.bin", "r+b") as handle:
        handle.write(b"Z")
    os.remove(f"{path}/state.json")
    code, out, _ = cli("verify", "r", "--step", "20", "--deep", "--json")
    assert code == 3
    problems = {p["file"]: p["kind"] for p in json.loads(out)["problems"]}
    assert problems == {"w.bin": "checksum", "state.json": "missing"}
    code, out, _ = cli("verify", "r", "--step", "20", "--deep")
    assert code == 3 and "w.bin" in out and "state.json" in out
    assert cli("verify", "r")[0] == 0  # the latest, 30, is intact


def test_pin_unpin_and_gc(cli, populated, catalog):
    assert cli("pin", "r", "10")[0] == 0
    code, out, _ = cli("gc", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["deleted"] == []
    assert cli("unpin", "r", "10")[0] == 0
    code, out, _ = cli("gc", "--json")
    assert [d["step"] for d in json.loads(out)["deleted"]] == [10]
    assert populated.store.run("r").committed_steps() == [20, 30]
    code, out, _ = cli("gc")
    assert code == 0 and "0 checkpoint(s)" in out


def test_sync_indexes_a_storage_url(cli, local_backend, catalog):
    store = local_backend.open_store()
    from zephon.locations import RunLocation

    save_step(start(RunLocation("imported", store, "imported")), 5)
    code, out, _ = cli("sync", local_backend.url, "--json")
    assert code == 0 and json.loads(out)["runs"] == ["imported"]
    assert catalog.latest_committed("imported").step == 5


def test_db_current_and_upgrade_on_an_empty_database(cli):
    code, out, _ = cli("db", "current", "--json")
    assert code == 0 and json.loads(out)["current"] is None
    code, out, _ = cli("db", "upgrade")
    assert code == 0 and "from empty to" in out
    code, out, _ = cli("db", "current", "--json")
    assert json.loads(out)["up_to_date"] is True
    code, out, _ = cli("db", "upgrade")
    assert code == 0 and "is at" in out


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["checkpoints", "nope"], 5, "run 'nope' is not in catalog"),
        (["pin", "nope", "1"], 5, "run 'nope' is not in catalog"),
        (["verify"], 6, "name a RUN"),
        (["latest", "r", "--save-dir", "oss://c/x"], 4, "pip install ossfs"),
    ],
)
def test_errors_are_one_line_with_a_documented_code(cli, argv, code, message):
    got, out, err = cli(*argv)
    assert got == code
    assert err.startswith("zephon: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["pin", "r", "-3"], "argument step: invalid step '-3'"),
        (["gc", "--storage-options", "{bad"], "argument --storage-options: the value is not valid"),
        (["nope"], "argument COMMAND: invalid choice: 'nope'"),
    ],
)
def test_usage_errors_exit_2_with_one_line(cli, argv, message):
    code, _, err = cli(*argv)
    assert code == 2
    assert err.startswith("zephon: error: ") and message in err and err.count("\n") == 1
    assert "--help`" in err  # the fix: where the accepted values are listed


def test_an_outdated_catalog_names_the_upgrade_command(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    Catalog(url).close()
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("UPDATE alembic_version SET version_num = 'old0000'"))
    engine.dispose()
    assert main(["runs", "--catalog", url]) == 5
    err = capsys.readouterr().err
    assert "zephon db upgrade" in err


def test_the_installed_command_runs_without_a_traceback(tmp_path):
    env = {**os.environ, "ZEPHON_CATALOG_URL": f"sqlite:///{tmp_path / 'c.db'}"}
    zephon = os.path.join(os.path.dirname(sys.executable), "zephon")
    done = subprocess.run(
        [zephon, "pin", "missing-run", "1"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 5
    assert done.stderr.startswith("zephon: error: run 'missing-run' is not in catalog")
    done = subprocess.run(
        [zephon, "latest", "missing-run"], env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stderr) == (1, "")  # nothing found, as for a run without one
    assert "run 'missing-run' is not in catalog" in done.stdout
    done = subprocess.run(
        [zephon, "runs", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and json.loads(done.stdout) == []
    # the catalog commands never import torch
    probe = "import sys, zephon.cli; zephon.cli.main(['runs']); assert 'torch' not in sys.modules"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_export_writes_safetensors_of_the_latest_checkpoint(
    cli, catalog_url, local_backend, tmp_path
):
    import torch
    from safetensors.torch import load_file

    from zephon.checkpointing import CheckpointManager
    from zephon.config import CheckpointingConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    store_root = local_backend.url
    config = CheckpointingConfig(save_dir=store_root, catalog_url=catalog_url)
    with CheckpointManager(config, run_name="m", total_steps=5) as manager:
        manager.save(5, {"model": model})
    out = tmp_path / "export"
    code, stdout, _ = cli("export", "m", "--out", str(out), "--json")  # found in the catalog
    assert code == 0 and json.loads(stdout)["step"] == 5
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    code, _, err = cli("export", "m", "--save-dir", store_root, "--out", str(out))
    assert code == 6 and "is not empty" in err


@pytest.mark.slow
def test_demo_resumes_bit_for_bit(tmp_path, capsys):
    code = main(
        [
            "demo",
            "--json",
            "--work-dir",
            str(tmp_path),
            "--steps",
            "8",
            "--kill-after",
            "5",
            "--ranks",
            "2",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["identical"] is True
    assert result["resumed_from"] == 4 and set(result["losses"]) == {"5", "6", "7", "8"}


@pytest.mark.slow
def test_demo_resumes_bit_for_bit_on_azure(tmp_path, capsys, azure_backend, monkeypatch):
    """``zephon demo --save-dir az://...``: every rank writes through adlfs to Azurite. The
    ranks are forked from the tests' zygote (tests/zygote.py); the test above starts them as
    the command does."""
    from tests.ranks import demo_ranks
    from zephon.demo import launch

    monkeypatch.setattr(launch, "Ranks", demo_ranks())
    save_dir = f"{azure_backend.url}/demo"
    options = json.dumps(azure_backend.storage_options)
    argv = ["demo", "--json", "--work-dir", str(tmp_path), "--save-dir", save_dir]
    argv += ["--storage-options", options, "--steps", "8", "--kill-after", "5", "--ranks", "2"]
    code = main(argv)
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["identical"] is True
    assert result["resumed_from"] == 4 and set(result["losses"]) == {"5", "6", "7", "8"}
    from zephon.storage import CheckpointStore

    with CheckpointStore(save_dir, azure_backend.storage_options) as store:
        (run,) = [name for name in store.runs() if not name.endswith("-reference")]
        assert max(store.run(run).committed_steps()) == 8  # on Azure, where it was saved


def test_an_unexpected_error_is_still_one_line(monkeypatch, capsys):
    from zephon.cli import commands

    def broken(args):
        raise RuntimeError("something no one foresaw")

    monkeypatch.setattr(commands, "cmd_runs", broken)
    assert main(["runs"]) == 70
    err = capsys.readouterr().err
    assert err.startswith("zephon: error: unexpected RuntimeError: something no one foresaw")
    assert "ZEPHON_DEBUG=1" in err and err.count("\n") == 1
