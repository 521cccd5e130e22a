"""No credential reaches a person: every ``zephon`` error line, success output, log record,
repr and catalog row masks secrets from URLs, ``--storage-options``, the environment and
catalog URLs, while still naming the bucket, path or database it is about."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from sqlalchemy.engine import make_url

from tests.servers import free_port
from tests.zephon.saves import save_step, start
from zephon.catalog import Catalog
from zephon.cli import main
from zephon.config import CheckpointingConfig, ModelStageConfig, load_job_config
from zephon.errors import ConfigError
from zephon.locations import (
    RETRY_ENV,
    STORAGE_OPTIONS_ENV,
    RunLocation,
    known_secrets,
    run_location,
)
from zephon.storage import CheckpointStore

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzEXAMPLEKEY"
TOKEN = "FwoGZXIvYXdzEXAMPLE-session-token"
URL_SECRET = "URLSECRET7x"
PG_PASSWORD = "pg-Secret-Pw-42"


def dead_options() -> dict:
    """S3 options for an endpoint nobody listens on, carrying credentials that must not leak."""
    return {
        "key": "AKIAIOSFODNN7EXAMPLE",
        "secret": SECRET,
        "token": TOKEN,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }


def assert_masked(text: str, *keeps: str) -> None:
    for secret in (SECRET, TOKEN, URL_SECRET, PG_PASSWORD):
        assert secret not in text, f"{secret!r} leaked in {text!r}"
    for kept in keeps:
        assert kept in text, f"{kept!r} missing from {text!r}"


def assert_one_error_line(err: str) -> None:
    assert err.startswith("zephon: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'catalog.db'}"


#: one try of every storage request: the endpoints here are dead on purpose
NO_RETRY_JSON = json.dumps({"max_attempts": 1})


@pytest.fixture
def cli(sqlite_url, capsys, monkeypatch):
    """``zephon <command> --catalog <sqlite> ...`` in-process: (exit code, stdout, stderr)."""
    monkeypatch.setenv(RETRY_ENV, NO_RETRY_JSON)

    def run(*argv: str, catalog: str | None = None):
        code = main([argv[0], "--catalog", catalog or sqlite_url, *argv[1:]])
        out, err = capsys.readouterr()
        return code, out, err

    return run


# -- credentials in a storage URL --------------------------------------------------------------

LEAKY_URLS = [
    f"s3://AKIAXXXX:{URL_SECRET}@bucket/ckpt",
    f"s3://bucket/ckpt?X-Amz-Signature={URL_SECRET}",
    f"s3://bucket/ckpt?secret={URL_SECRET}",
    f"gs://bucket/ckpt?token={URL_SECRET}",
]


@pytest.mark.parametrize("url", LEAKY_URLS)
@pytest.mark.parametrize("command", ["latest", "verify", "sync"])
def test_a_storage_url_with_credentials_is_one_masked_line(cli, command, url):
    argv = [command, url] if command == "sync" else [command, "r", "--save-dir", url]
    code, out, err = cli(*argv)
    assert code == 4
    assert_one_error_line(err)
    assert_masked(err + out, "bucket/ckpt", "storage_options")


# -- credentials in storage options ------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["latest", "r", "--save-dir", "s3://bucket/ckpt"],
        ["latest", "--save-dir", "s3://bucket/ckpt"],
        ["verify", "r", "--save-dir", "s3://bucket/ckpt", "--step", "5"],
        ["sync", "s3://bucket/ckpt"],
    ],
)
@pytest.mark.parametrize("via", ["argument", "environment"])
def test_an_unreachable_endpoint_is_one_line_without_the_options_secrets(
    cli, monkeypatch, argv, via
):
    options = json.dumps(dead_options())
    if via == "argument":
        argv = [*argv, "--storage-options", options]
    else:
        monkeypatch.setenv(STORAGE_OPTIONS_ENV, options)
    code, out, err = cli(*argv)
    assert code == 4
    assert_one_error_line(err)
    assert_masked(err + out, "s3://bucket/ckpt", "storage_options")


def test_gc_reports_a_run_whose_storage_is_unreachable_without_secrets(cli, sqlite_url):
    with Catalog(sqlite_url) as catalog:
        catalog.ensure_run("r", "s3://zephon-gc-bucket/ckpt")
    options = json.dumps(dead_options())
    code, out, err = cli("gc", "--storage-options", options)
    assert code == 3 and err == ""
    assert_masked(out, "problem: run r", "s3://zephon-gc-bucket/ckpt")
    code, out, _ = cli("gc", "--json", "--storage-options", options)
    assert code == 3
    (problem,) = json.loads(out)["problems"]
    assert_masked(problem, "s3://zephon-gc-bucket/ckpt")


def test_a_bucket_that_does_not_exist_is_reported_without_secrets(cli, s3):
    options = json.dumps({**s3.storage_options(), "key": "AKIAIOSFODNN7EXAMPLE", "secret": SECRET})
    for command in ("latest", "verify"):
        code, out, err = cli(
            command,
            "r",
            "--save-dir",
            "s3://zephon-missing-bucket/ckpt",
            "--storage-options",
            options,
        )
        assert code == 1 and err == ""
        assert_masked(out, "no complete checkpoint")
    code, out, err = cli("sync", "s3://zephon-missing-bucket/ckpt", "--storage-options", options)
    assert code == 4
    assert_one_error_line(err)
    assert_masked(out + err, "s3://zephon-missing-bucket/ckpt")


# -- catalog URLs with passwords -------------------------------------------------------------


@pytest.fixture
def unreachable_catalog_urls(postgres_url) -> list[str]:
    """PostgreSQL URLs that cannot connect, with the password in each place it may be given."""
    server = make_url(postgres_url)
    host = f"{server.host}:{server.port or 5432}"
    return [
        # a role that does not exist on the real server, password in the URL's userinfo
        f"postgresql+psycopg://zephon_nobody:{PG_PASSWORD}@{host}/zephon_no_db",
        # the same, password as a query parameter (which SQLAlchemy does not hide)
        f"postgresql+psycopg://zephon_nobody@{host}/zephon_no_db?password={PG_PASSWORD}",
        # nothing listening
        f"postgresql+psycopg://zephon_nobody:{PG_PASSWORD}@127.0.0.1:{free_port()}/zephon_no_db",
    ]


@pytest.mark.parametrize(
    "argv", [["runs"], ["gc"], ["sync", "{tmp}"], ["db", "current"], ["db", "upgrade"]]
)
def test_a_catalog_that_cannot_connect_is_one_line_without_its_password(
    cli, unreachable_catalog_urls, argv, tmp_path
):
    argv = [arg.format(tmp=tmp_path) for arg in argv]  # sync: a storage root that exists
    for url in unreachable_catalog_urls:
        code, out, err = cli(*argv, catalog=url)
        assert code == 5, err
        assert_one_error_line(err)
        assert_masked(err + out, "zephon_nobody", "zephon_no_db", "is unavailable")


def test_catalog_errors_raised_from_the_api_mask_the_password(unreachable_catalog_urls):
    for url in unreachable_catalog_urls:
        with pytest.raises(Exception) as info:
            Catalog(url)
        assert_masked(str(info.value), "zephon_no_db")
        assert_masked(info.value.url, "zephon_no_db")


# -- the CLI's own lines -----------------------------------------------------------------------


def test_usage_errors_quoting_an_argument_are_redacted(capsys):
    for argv in (
        ["pin", "r", f"postgresql://u:{PG_PASSWORD}@h/db"],
        ["db", f"s3://AKIA:{URL_SECRET}@b/x"],
        ["sync", "s3://b/x", f"--secret={SECRET}"],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "error:" in err
        assert_masked(err)


def test_the_unexpected_error_line_is_redacted(monkeypatch, capsys):
    from zephon.cli import commands

    def broken(args):
        raise RuntimeError(
            f"boom at s3://AKIA:{URL_SECRET}@bucket/ckpt after sending {SECRET} as {TOKEN}"
        )

    monkeypatch.setattr(commands, "cmd_runs", broken)
    options = json.dumps(dead_options())
    assert main(["runs", "--storage-options", options]) == 70
    err = capsys.readouterr().err
    assert_one_error_line(err)
    assert_masked(err, "unexpected RuntimeError", "s3://AKIA:***@bucket/ckpt", "ZEPHON_DEBUG=1")


def test_known_secrets_come_from_arguments_and_the_environment(monkeypatch):
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps({"secret": SECRET}))
    monkeypatch.setenv("ZEPHON_CATALOG_URL", f"postgresql://u:{PG_PASSWORD}@h/db")
    found = known_secrets(
        [f"s3://AKIA:{URL_SECRET}@b/x", f"--storage-options={json.dumps({'token': TOKEN})}"]
    )
    assert {SECRET, TOKEN, URL_SECRET, PG_PASSWORD} <= found


def test_the_installed_command_prints_no_secret(tmp_path):
    env = {
        **os.environ,
        "ZEPHON_CATALOG_URL": f"sqlite:///{tmp_path / 'c.db'}",
        STORAGE_OPTIONS_ENV: json.dumps(dead_options()),
        RETRY_ENV: NO_RETRY_JSON,
    }
    zephon = os.path.join(os.path.dirname(sys.executable), "zephon")
    for argv, keeps in (
        (["latest", "r", "--save-dir", f"s3://AKIAXXXX:{URL_SECRET}@bucket/ckpt"], "bucket/ckpt"),
        (["sync", "s3://bucket/ckpt"], "s3://bucket/ckpt"),
    ):
        done = subprocess.run([zephon, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 4, done.stderr
        assert_one_error_line(done.stderr)
        assert_masked(done.stderr + done.stdout, keeps)


# -- reprs -------------------------------------------------------------------------------------


def test_config_reprs_mask_credentials_and_keep_the_rest():
    config = CheckpointingConfig(
        save_dir=f"s3://AKIA:{URL_SECRET}@bucket/ckpt",
        catalog_url=f"postgresql+psycopg://zephon:{PG_PASSWORD}@db.example/zephon",
        storage_options={
            "key": "AKIAIOSFODNN7EXAMPLE",
            "secret": SECRET,
            "client_kwargs": {"region_name": "eu-west-1", "aws_session_token": TOKEN},
        },
    )
    stage = ModelStageConfig(source_checkpoint=f"https://u:{URL_SECRET}@hub.example/base")
    job = load_job_config(
        {
            "trainer": {
                "checkpointing": {
                    "save_dir": "s3://bucket/ckpt",
                    "storage_options": {"token": TOKEN},
                }
            }
        }
    )
    for shown in (repr(config), str(config), f"{config}", f"{config!r}"):
        assert_masked(
            shown, "bucket/ckpt", "db.example/zephon", "region_name", "eu-west-1", "num_to_keep"
        )
    for shown in (repr(stage), f"{stage}"):
        assert_masked(shown, "hub.example/base")
    assert_masked(repr(job), "s3://bucket/ckpt", "'token': '***'")
    assert config.storage_options["secret"] == SECRET  # only the display is masked


def test_store_and_run_location_reprs_mask_credentials():
    store = CheckpointStore("s3://bucket/ckpt", dead_options())
    location = RunLocation("r", store, "r")
    for shown in (repr(location), str(location), f"{location}", repr(store), f"{store}"):
        assert_masked(shown, "s3://bucket/ckpt")
    assert_masked(repr(store.location), "s3://bucket/ckpt")


# -- a real run: logs, catalog rows and output ------------------------------------------------


def test_a_run_on_s3_with_secret_options_logs_and_stores_no_secret(
    cli, s3, s3_backend, sqlite_url, caplog
):
    options = {**s3.storage_options(), "key": "AKIAIOSFODNN7EXAMPLE", "secret": SECRET}
    caplog.set_level(logging.DEBUG, logger="zephon")
    with Catalog(sqlite_url) as catalog:
        store = CheckpointStore(s3_backend.url, options)
        record = catalog.ensure_run("r", store.location.canonical_url)
        location = run_location(record, options)
        save_step(start(location, catalog), 5, catalog)
        rows = [catalog.get_run("r").storage_url, catalog.get_checkpoint("r", 5).path]
    assert_masked(" ".join(rows), s3_backend.url)
    assert_masked(" ".join(r.getMessage() for r in caplog.records))
    flags = ["--storage-options", json.dumps(options)]
    for argv in (["latest", "r"], ["verify", "r", "--deep"], ["runs"], ["checkpoints", "r"]):
        for extra in ([], ["--json"]):
            code, out, err = cli(*argv, *flags, *extra)
            assert code == 0, err
            assert_masked(out + err)


# -- configuration errors and failure reasons ------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"catalog_url": f"zephon:{PG_PASSWORD}@db.example/zephon"},
        {"storage_options": f"secret={SECRET}"},
    ],
)
def test_config_errors_do_not_echo_secrets(kwargs):
    with pytest.raises(ConfigError) as info:
        CheckpointingConfig(save_dir="s3://bucket/ckpt", **kwargs)
    assert_masked(str(info.value))


def test_a_failed_save_records_its_reason_without_secrets(sqlite_url, local_backend):
    from zephon.saving import Save

    with Catalog(sqlite_url) as catalog:
        store = local_backend.open_store()
        location = run_location(catalog.ensure_run("r", store.location.canonical_url), {})
        attempt = start(location, catalog)
        with pytest.raises(RuntimeError), Save.begin(attempt, 5, catalog=catalog):
            raise RuntimeError(f"upload to https://u:{URL_SECRET}@host/x failed, secret={SECRET}")
        reason = catalog.get_checkpoint("r", 5).failure_reason
    assert reason is not None and "RuntimeError" in reason
    assert_masked(reason)
