"""A PostgreSQL cluster of the tests' own, on a free port, that a test may stop and start: the
catalog outage tests need a database that really goes away (never the shared server on 5432,
which other tests and people use). Built with the Debian cluster tools (``pg_createcluster``,
``pg_ctlcluster``, ``pg_dropcluster``) with trust authentication on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

from tests.servers import ServerUnavailable, free_port

_TOOLS = ("pg_createcluster", "pg_ctlcluster", "pg_dropcluster")


def _installed_version() -> str:
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        raise ServerUnavailable(f"{', '.join(missing)} not installed (apt-get install postgresql)")
    try:
        versions = sorted(os.listdir("/etc/postgresql"), key=lambda v: float(v))
    except (OSError, ValueError) as exc:
        raise ServerUnavailable(f"no PostgreSQL version under /etc/postgresql: {exc}") from exc
    if not versions:
        raise ServerUnavailable("no PostgreSQL version under /etc/postgresql")
    return versions[-1]


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ServerUnavailable(f"{' '.join(argv)} failed: {done.stderr.strip()[:500]}")


class PostgresCluster:
    """One cluster: ``url_for(database)``, ``create_database()``, ``stop()``, ``start()``."""

    def __init__(self) -> None:
        self.version = _installed_version()
        self.name = f"zephon_outage_{os.getpid()}"
        self.port = free_port()
        _run(
            "pg_createcluster",
            self.version,
            self.name,
            "-p",
            str(self.port),
            "--",
            "--auth=trust",
        )
        try:
            self.start()
            self.create_database("test")
        except BaseException:
            self.drop()
            raise

    def url_for(self, database: str, password: str | None = None) -> str:
        user = "postgres" if password is None else f"postgres:{password}"
        return f"postgresql+psycopg://{user}@127.0.0.1:{self.port}/{database}"

    def _connect(self):
        import psycopg

        return psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        )

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; its name."""
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with self._connect() as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        with self._connect() as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        """Stop the server (fast shutdown: open connections are cut, new ones refused)."""
        _run("pg_ctlcluster", self.version, self.name, "stop", "-m", "fast")

    def start(self) -> None:
        """Start the server (if it is not running) and wait until it accepts connections."""
        if self.running:
            return
        _run("pg_ctlcluster", self.version, self.name, "start")
        deadline = time.monotonic() + 30
        while True:
            try:
                with self._connect():
                    return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"cluster {self.name} did not start: {exc}") from exc
                time.sleep(0.1)

    @property
    def running(self) -> bool:
        try:
            with self._connect():
                return True
        except Exception:
            return False

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """The server is stopped inside the block and running again after it."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def drop(self) -> None:
        with contextlib.suppress(ServerUnavailable):
            _run("pg_dropcluster", "--stop", self.version, self.name)
