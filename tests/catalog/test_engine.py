"""Connections: SQLite pragmas, PostgreSQL errors with masked passwords, URL checks, layering."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sqlalchemy import text

from tests.mounts import fill
from zephon.catalog import Catalog, CatalogUnavailableError, InvalidValueError, mask_url
from zephon.catalog.engine import Database


def test_sqlite_connections_use_wal_busy_timeout_and_foreign_keys(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/c.db")
    try:
        with db.read("test") as session:
            assert session.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert session.execute(text("PRAGMA busy_timeout")).scalar() == 30000
            assert session.execute(text("PRAGMA foreign_keys")).scalar() == 1
    finally:
        db.dispose()


def test_sqlite_write_sessions_take_the_write_lock_at_begin(tmp_path):
    # A writer holding BEGIN IMMEDIATE makes a second BEGIN IMMEDIATE wait (and time out here),
    # which proves write() asks for the lock up front rather than on the first write.
    import sqlite3

    url = f"sqlite:///{tmp_path}/c.db"
    Catalog(url).close()
    db = Database(url)
    try:
        with db.write("test") as session:
            session.execute(text("SELECT 1"))  # sessions begin lazily, on the first statement
            other = sqlite3.connect(tmp_path / "c.db", timeout=0.1, isolation_level=None)
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
            other.close()
    finally:
        db.dispose()


def test_sqlite_catalog_creates_its_parent_directory(tmp_path):
    with Catalog(f"sqlite:///{tmp_path}/a/b/catalog.db") as catalog:
        assert catalog.list_runs() == []
    assert (tmp_path / "a" / "b" / "catalog.db").exists()


def test_mask_url_hides_passwords():
    masked = mask_url("postgresql+psycopg://alice:s3cret@db.example:5432/zephon")
    assert "s3cret" not in masked
    assert masked == "postgresql+psycopg://alice:***@db.example:5432/zephon"
    assert "s3cret" not in mask_url("not a url://alice:s3cret@host")


def test_unreachable_postgres_names_the_masked_url_and_the_fix():
    url = "postgresql+psycopg://alice:s3cret@127.0.0.1:1/zephon"
    with pytest.raises(CatalogUnavailableError) as caught:
        Catalog(url)
    message = str(caught.value)
    assert "s3cret" not in message
    assert "postgresql+psycopg://alice:***@127.0.0.1:1/zephon" in message
    assert "ZEPHON_CATALOG_URL" in message
    assert caught.value.url == "postgresql+psycopg://alice:***@127.0.0.1:1/zephon"


def test_wrong_postgres_password_never_appears_in_the_error(postgres_url):
    from sqlalchemy.engine import make_url

    url = make_url(postgres_url).set(password="s3cret-pw", database="zephon_no_such_db_x")
    with pytest.raises(CatalogUnavailableError) as caught:
        Catalog(url.render_as_string(hide_password=False))
    assert "s3cret-pw" not in str(caught.value)
    assert "***" in str(caught.value)


@pytest.mark.parametrize("path", ["/proc/nope/c.db", "{file}/c.db"])
def test_a_sqlite_directory_that_cannot_be_created_is_unavailable_not_an_oserror(path, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    url = "sqlite:///" + path.format(file=blocker)
    with pytest.raises(CatalogUnavailableError, match="cannot create the directory") as caught:
        Catalog(url)
    assert "\n" not in str(caught.value)
    assert "at a directory you can write" in str(caught.value)


def _refusal(url: str) -> str:
    """The one-line message of a catalog that cannot write its SQLite file."""
    with pytest.raises(CatalogUnavailableError) as caught, Catalog(url) as catalog:
        catalog.create_run("r2", "/data/ckpt")
    message = str(caught.value)
    assert "\n" not in message and "database server" not in message
    return message


def test_sqlite_in_a_read_only_directory_says_so_and_how_to_fix_it(tmp_path, mounts):
    with Catalog(f"sqlite:///{tmp_path}/c.db") as catalog:
        catalog.create_run("r1", "/data/ckpt")
    mounts.read_only(tmp_path)
    for name in ("c.db", "new.db"):  # an existing catalog, and one to create
        message = _refusal(f"sqlite:///{tmp_path}/{name}")
        assert f"the directory {tmp_path} " in message and "read-only" in message
        assert "writable directory" in message


def test_a_read_only_sqlite_file_says_so_and_how_to_fix_it(tmp_path, mounts):
    with Catalog(f"sqlite:///{tmp_path}/c.db") as catalog:
        catalog.create_run("r1", "/data/ckpt")
    mounts.read_only(tmp_path / "c.db")
    message = _refusal(f"sqlite:///{tmp_path}/c.db")
    assert f"the file {tmp_path}/c.db is read-only" in message
    assert "make it writable" in message


def test_sqlite_on_a_full_disk_says_the_disk_is_full(tmp_path, mounts):
    disk = mounts.small_disk(tmp_path / "disk", "512k")
    url = f"sqlite:///{disk}/c.db"
    with Catalog(url) as catalog:
        catalog.create_run("r0", "/data/ckpt")
        fill(disk)
        with pytest.raises(CatalogUnavailableError) as caught:
            for index in range(1, 200):
                catalog.create_run(f"r{index}", "/data/" + "x" * 4000)
    message = str(caught.value)
    assert f"the disk holding {disk}/c.db is full" in message
    assert "free space" in message and "database server" not in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "url",
    ["sqlite://", "sqlite:///:memory:", "mysql://x/y", "not a url", "postgresql+asyncpg://h/d"],
)
def test_unsupported_catalog_urls_are_refused(url):
    with pytest.raises(InvalidValueError, match="sqlite:///PATH"):
        Catalog(url)


def test_postgresql_without_driver_uses_psycopg(postgres_url):
    from sqlalchemy.engine import make_url

    plain = make_url(postgres_url).set(drivername="postgresql").render_as_string(False)
    db = Database(plain)
    try:
        assert db.engine.url.drivername == "postgresql+psycopg"
    finally:
        db.dispose()


def test_catalog_imports_neither_storage_nor_zephon_nor_fsspec_nor_torch():
    code = (
        "import sys, zephon.catalog, zephon.catalog.catalog, zephon.catalog.schema\n"
        "import zephon.catalog.retention\n"
        "own = ('zephon.catalog', 'zephon.migrations')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fsspec', 'torch')\n"
        "             or m.startswith('zephon.') and not m.startswith(own))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_catalog_errors_survive_pickling_as_a_distributed_job_sends_them():
    import pickle

    from zephon.catalog import (
        CheckpointExistsError,
        CheckpointRecordNotFoundError,
        FencedOutError,
        InvalidValueError,
        MigrationsNotFoundError,
        ReplicaNotFoundError,
        StateConflictError,
    )

    errors = [
        CheckpointExistsError("sqlite:///c.db", "r", 5, "s3://b/ckpt/r/save-5"),
        FencedOutError("sqlite:///c.db", "r", 1, None),
        InvalidValueError("step", -1, "an integer from 0 to 2**63 - 1"),
        CatalogUnavailableError("sqlite:///c.db", "disk full"),
        CheckpointRecordNotFoundError("sqlite:///c.db", "r", 5, save_id="a", found_save="b"),
        ReplicaNotFoundError("sqlite:///c.db", "r", 5, "local", "n1"),
        StateConflictError("sqlite:///c.db", "r", 5, "pending", "commit", "a", "b"),
        MigrationsNotFoundError("/site-packages/migrations"),
    ]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert vars(copy) == vars(error)
