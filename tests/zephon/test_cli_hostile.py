"""Hostile input and operator slips: each gives one line naming the thing and the fix, with its
documented exit code (2 usage, 4 storage, 5 catalog, 6 other; 1 nothing found, 3 problems),
never exit 70 or a traceback. Each class of value is tested, not only the reported instance."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.zephon.saves import save_step, start
from tests.zephon.test_composition import make_run
from zephon.cli import main
from zephon.locations import RunLocation
from zephon.storage.layout import MARKER_NAME


def one_line(err: str) -> str:
    assert err.startswith("zephon: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def populated(catalog, local_backend):
    location = make_run(catalog, local_backend, num_to_keep=5)
    attempt = start(location, catalog)
    for step in (10, 20, 30):
        save_step(attempt, step, catalog)
    return location


# -- 2: bad usage, refused where it is parsed ------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["pin", "r", "99999999999999999999999"],
        ["unpin", "r", "9223372036854775808"],  # BIGINT's maximum + 1
        ["pin", "r", "-1"],
        ["pin", "r", "1e3"],
        ["pin", "r", "٣"],  # a digit, but not an ASCII one
        ["pin", "r", "9" * 5000],  # beyond Python's int parsing limit
        ["verify", "r", "--step", "99999999999999999999999"],
        ["export", "r", "--out", "x", "--step", "99999999999999999999999"],
    ],
)
def test_every_step_argument_refuses_steps_beyond_bigint(usage, argv):
    code, _, err = usage(*argv)
    assert code == 2
    assert "invalid step" in one_line(err) and "9223372036854775807" in err
    assert len(err) < 400  # a megabyte of input still gives a short line


@pytest.mark.parametrize("option", ["--grace", "--pending-grace", "--lease"])
@pytest.mark.parametrize("value", ["999999999999w", "3651d", "1" * 400, "-1h", "inf", "nan", "1y"])
def test_every_duration_option_is_bounded(usage, option, value):
    code, _, err = usage("gc", f"{option}={value}")
    assert code == 2
    assert f"argument {option}: invalid duration" in one_line(err) and "3650d" in err


def test_a_zero_lease_is_refused_where_it_is_parsed_and_a_zero_grace_is_fine(usage):
    code, _, err = usage("gc", "--lease", "0")
    assert code == 2 and "argument --lease" in one_line(err) and "more than 0" in err
    assert usage("gc", "--grace", "0", "--pending-grace", "0s", "--lease", "1s")[0] == 0


@pytest.mark.parametrize("value", ["0", "-5GB", "99999999999PB", "1" * 400, "5 parsecs"])
def test_sizes_are_bounded(usage, value):
    code, _, err = usage("export", "r", "--out", "x", f"--max-shard-size={value}")
    assert code == 2 and "invalid size" in one_line(err)


@pytest.mark.parametrize("argv", [["--ranks", "0"], ["--ranks", "100000"], ["--steps", "1e9"]])
def test_demo_counts_are_bounded(usage, argv):
    code, _, err = usage("demo", *argv)
    assert code == 2 and "invalid number" in one_line(err)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{bad", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('"s3"', "must be a JSON object"),
        ("[" * 100_000, "nests too deeply"),
        ('{"n": ' + "9" * 5000 + "}", "number too long"),
    ],
)
def test_storage_options_must_be_a_json_object(usage, monkeypatch, text, message):
    code, _, err = usage("gc", "--storage-options", text)
    assert code == 2 and "argument --storage-options" in one_line(err) and message in err
    assert len(err) < 400
    # the same value from the environment is a configuration error naming the variable
    monkeypatch.setenv("ZEPHON_STORAGE_OPTIONS", text)
    code, _, err = usage("latest", "r", "--save-dir", "memory://nowhere")
    assert code == 6 and "$ZEPHON_STORAGE_OPTIONS" in one_line(err) and message in err


def test_storage_options_that_are_not_an_object_are_not_echoed(usage):
    # a bare string may well be a credential: it has no key name to be masked by
    code, _, err = usage("gc", "--storage-options", '"AKIAIOSFODNN7EXAMPLE"')
    assert code == 2 and "got a JSON str" in one_line(err) and "AKIAIOSFODNN7" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["latest", "a b"],
        ["checkpoints", "../etc"],
        ["pin", "x" * 1000, "1"],
        ["gc", "--run", "save-5"],
        ["sync", "/tmp", "--inference-name", "_attempts"],
    ],
)
def test_every_run_argument_is_a_valid_run_name(usage, argv):
    code, _, err = usage(*argv)
    assert code == 2 and "invalid run name" in one_line(err) and len(err) < 400


def test_common_options_may_come_before_the_command(catalog_url, populated, capsys):
    assert main(["--catalog", catalog_url, "--json", "runs"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["r"]


# -- 4: storage ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "detail"),
    [
        # the error the backend raises depends on the botocore version
        ('{"client_kwargs": 5}', "(AttributeError|TypeError: 'int' object is not a mapping)"),
        ('{"bogus_option": 1}', "unexpected keyword argument 'bogus_option'"),
    ],
)
def test_storage_options_the_backend_refuses_are_a_storage_error(
    cli, catalog, s3_backend, options, detail
):
    code, _, err = cli("latest", "r", "--save-dir", s3_backend.url, "--storage-options", options)
    assert code == 4 and s3_backend.url in one_line(err) and re.search(detail, err)
    assert "fix --storage-options" in err
    code, _, err = cli("sync", s3_backend.url, "--storage-options", options)
    assert code == 4 and s3_backend.url in one_line(err)
    # a catalog run's storage: the message names the run's URL, found where it failed
    make_run(catalog, s3_backend, name="on-s3")
    # gc goes on to the other runs: the run it could not finish is a problem (exit 3)
    code, out, err = cli("gc", "--storage-options", options)
    assert (code, err) == (3, "")
    problem = next(line for line in out.splitlines() if line.startswith("problem: run on-s3:"))
    assert s3_backend.url in problem and re.search(detail, problem) and "storage options" in problem


def test_storage_options_from_the_environment_are_named_as_such(cli, s3_backend, monkeypatch):
    monkeypatch.setenv("ZEPHON_STORAGE_OPTIONS", '{"bogus_option": 1}')
    code, _, err = cli("latest", "r", "--save-dir", s3_backend.url)
    assert code == 4 and "fix $ZEPHON_STORAGE_OPTIONS" in one_line(err)


@pytest.mark.parametrize("command", ["latest", "verify", "sync"])
def test_a_url_that_cannot_connect_is_a_storage_error(usage, command):
    url = "ftp://127.0.0.1:1/x"
    argv = [command, url] if command == "sync" else [command, "r", "--save-dir", url]
    code, _, err = usage(*argv)
    assert code == 4 and url in one_line(err) and "ConnectionRefusedError" in err
    assert "reachable" in err


def test_a_catalog_run_whose_storage_cannot_connect_is_named(cli, catalog):
    catalog.ensure_run("far", "ftp://127.0.0.1:1/ckpt")
    for argv in (["latest", "far"], ["verify", "far"]):
        code, _, err = cli(*argv)
        assert code == 4 and "ftp://127.0.0.1:1/ckpt" in one_line(err), (argv, err)
    # gc goes on to the other runs and reports the one it could not reach (exit 3)
    code, out, err = cli("gc")
    assert (code, err) == (3, "")
    assert "problem: run far: cannot open ftp://127.0.0.1:1/ckpt" in out


@pytest.mark.parametrize(
    "url",
    [
        "ftp://127.0.0.1:1/x",
        "http://127.0.0.1:1/x",
        "sftp://127.0.0.1:1/x",
        "hdfs://127.0.0.1:1/x",
        "github://127.0.0.1:1/x",
        "dbfs://127.0.0.1:1/x",
        "reference://x",
        "zip://x",
        "tar://x",
        "data://x",
        "dir://x",
        "blockcache://x",
        "nosuchprotocol://x",
        "s3://",
        "::",
    ],
)
def test_urls_of_many_protocols_give_one_line(usage, url, monkeypatch):
    # a refused connection is transient: under the default policy it is asked again for two
    # minutes; the message after the last try is what this test reads
    monkeypatch.setenv("ZEPHON_RETRY", '{"max_attempts": 1}')
    for argv in (["latest", "r", "--save-dir", url], ["sync", url]):
        code, out, err = usage(*argv)
        assert code in (1, 2, 4), (argv, code, err)
        if code == 1:
            assert err == "" and out.count("\n") == 1
        else:
            one_line(err)


@pytest.mark.parametrize("missing", ["directory", "bucket", "prefix"])
def test_sync_of_a_location_that_does_not_exist_names_it(
    cli, catalog, local_backend, s3_backend, missing
):
    options = json.dumps(s3_backend.storage_options)
    url = {
        "directory": os.path.join(local_backend.url, "no", "such", "dir"),
        "bucket": "s3://zt-no-such-bucket/ckpt",
        "prefix": f"{s3_backend.url}/no/such/prefix",
    }[missing]
    code, _, err = cli("sync", url, "--storage-options", options)
    assert code == 4 and url in one_line(err) and "nothing to sync" in err
    assert catalog.list_runs() == []


def test_a_damaged_marker_with_huge_sizes_is_a_problem_not_a_crash(cli, catalog, local_backend):
    store = local_backend.open_store()
    location = RunLocation("imported", store, "imported")
    attempt = start(location)
    for step in (5, 6):
        save_step(attempt, step)
    marker = os.path.join(local_backend.url, "imported", "save-6", MARKER_NAME)
    with open(marker) as handle:
        manifest = json.load(handle)
    for entry in manifest["files"]:
        entry["size"] = 10**20
    manifest["total_bytes"] = 10**20 * len(manifest["files"])
    with open(marker, "w") as handle:
        json.dump(manifest, handle)

    code, out, err = cli("sync", local_backend.url)
    assert (code, err) == (3, "")
    assert "problem: run imported step 6:" in out and "beyond any real checkpoint" in out
    code, out, _ = cli("latest", "imported")
    assert code == 0 and out.strip().endswith("imported/save-5")
    code, out, _ = cli("latest", "imported", "--save-dir", local_backend.url)
    assert code == 0 and out.strip().endswith("imported/save-5")
    code, out, _ = cli("verify", "imported", "--step", "6", "--json")
    report = json.loads(out)
    assert code == 3 and report["ok"] is False
    assert report["problems"][0]["file"] == MARKER_NAME
    assert "beyond any real checkpoint" in report["problems"][0]["detail"]
    code, out, err = cli("gc", "--corrupt")
    assert code in (0, 3) and err == ""


def test_a_step_directory_beyond_bigint_is_a_problem_not_a_crash(cli, local_backend):
    store = local_backend.open_store()
    save_step(start(RunLocation("imported", store, "imported")), 5)
    huge = 10**23
    step_dir = os.path.join(local_backend.url, "imported", f"save-{huge}")
    os.makedirs(step_dir)
    with open(os.path.join(local_backend.url, "imported", "save-5", MARKER_NAME)) as handle:
        manifest = {**json.load(handle), "step": huge}
    with open(os.path.join(step_dir, MARKER_NAME), "w") as handle:
        json.dump(manifest, handle)
    for argv in (["sync", local_backend.url], ["gc"], ["latest", "imported"]):
        code, out, err = cli(*argv)
        # refused by the catalog's bounds (a problem of the run), never a driver overflow
        assert code in (0, 3, 5), (argv, code, err)
        if err:
            one_line(err)


# -- 5: catalog ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["runs"],
        ["checkpoints", "r"],
        ["latest", "r"],
        ["verify", "r"],
        ["gc"],
        ["pin", "r", "1"],
        ["db", "current"],
        ["db", "upgrade"],
    ],
)
def test_a_sqlite_catalog_that_cannot_be_created_is_a_catalog_error(argv, tmp_path, capsys):
    url = "sqlite:////proc/nope/c.db"
    assert main([*argv, "--catalog", url]) == 5
    err = one_line(capsys.readouterr().err)
    assert url in err and "at a directory you can write" in err


def test_sync_into_a_catalog_that_cannot_be_created_is_a_catalog_error(local_backend, capsys):
    store = local_backend.open_store()
    save_step(start(RunLocation("imported", store, "imported")), 5)
    assert main(["sync", local_backend.url, "--catalog", "sqlite:////proc/nope/c.db"]) == 5
    one_line(capsys.readouterr().err)


# -- 1: nothing found; 5: a catalog that cannot answer ---------------------------------------


@pytest.mark.parametrize("command", ["latest", "verify"])
def test_a_run_the_catalog_never_saw_is_nothing_found(cli, populated, command):
    code, out, err = cli(command, "never-seen")
    assert (code, err) == (1, "")
    assert out.count("\n") == 1 and "run 'never-seen' is not in catalog" in out
    assert "--save-dir" in out and "zephon sync" in out  # the ways to find it
    code, out, _ = cli(command, "never-seen", "--json")
    assert code == 1 and json.loads(out) is None


def test_latest_of_a_known_run_without_a_checkpoint_is_nothing_found(cli, catalog, local_backend):
    make_run(catalog, local_backend, name="empty")
    code, out, err = cli("latest", "empty")
    assert (code, err) == (1, "") and out == "no complete checkpoint for run empty\n"


@pytest.mark.parametrize(
    "url", ["postgresql+psycopg://postgres@127.0.0.1:1/nope", "sqlite:////proc/nope/c.db"]
)
def test_latest_exits_5_when_the_catalog_cannot_answer(url, capsys):
    assert main(["latest", "r", "--catalog", url]) == 5
    err = one_line(capsys.readouterr().err)
    assert "127.0.0.1:1" in err or "/proc/nope" in err


# -- the audit log's retention from the command line -----------------------------------------


def test_gc_prunes_old_events_unless_told_to_keep_them(cli, catalog, local_backend):
    location = make_run(catalog, local_backend)
    save_step(start(location, catalog), 10, catalog)
    logged = len(catalog.events(run="r"))
    code, out, _ = cli("gc", "--keep-events", "--events-age", "1s")
    assert code == 0 and "event(s) pruned" not in out
    assert len(catalog.events(run="r")) == logged  # nothing pruned
    code, out, _ = cli("gc")  # the default age (90d) prunes nothing this young
    assert code == 0 and ", 0 old event(s) pruned" in out
    time.sleep(0.05)
    code, out, _ = cli("gc", "--events-age", "0.01s")
    assert code == 0 and ", 0 old event(s) pruned" not in out and "old event(s) pruned" in out
    assert [event.action for event in catalog.events(run="r")] == []
    code, out, _ = cli("gc", "--dry-run", "--events-age", "0.01s")
    assert code == 0 and "event(s) pruned" not in out  # a dry run prunes nothing


def test_an_events_age_that_is_not_a_duration_is_a_usage_error(usage):
    code, _, err = usage("gc", "--events-age", "forever")
    assert code == 2 and "--events-age" in one_line(err)
