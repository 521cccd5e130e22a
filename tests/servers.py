"""Local stand-ins for the real services Zephon talks to, started as separate processes.

Used by the test suite (session fixtures in ``tests/conftest.py``) and by ``benchmarks/``:
moto's S3 server, gcp-storage-emulator, Azurite (Azure Blob Storage, from the npm package under
``.ci/node``), and a probe of the PostgreSQL server the machine runs.
Each server is a real HTTP or SQL endpoint on 127.0.0.1; nothing here patches a client library.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

# gcsfs probes every bucket's layout over gRPC first; the emulator cannot answer and each call
# would wait ~60 s. Must be set before gcsfs is imported anywhere in this process or its children.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

POSTGRES_URL_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


class ServerUnavailable(RuntimeError):
    """A local test server could not be started or reached."""


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; a common default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(x) for x in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free port of 127.0.0.1 for a server a test starts (moto, a rank 0's TCPStore...).

    Chosen at random below the kernel's ephemeral range: a port the kernel hands out itself
    (``bind(0)``) comes from the range every outgoing connection also draws from, so under
    parallel test workers another process's connection could take it before the server binds
    it (seen: gloo's rendezvous failing with EADDRINUSE)."""
    low, _ = _ephemeral_ports()
    chooser = random.SystemRandom()
    for _ in range(200):
        port = chooser.randrange(10_000, low) if low > 11_000 else chooser.randrange(1024, 10_000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every try was taken: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _console_script(name: str) -> str:
    # Prefer the script next to this interpreter, so a venv's server is used even if its bin/
    # directory is not on PATH.
    local = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(local):
        return local
    found = shutil.which(name)
    if found is None:
        raise ServerUnavailable(
            f"{name} is not installed; install the test extra: pip install -e '.[test]'"
        )
    return found


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerUnavailable(f"server for {url} exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # the server answered, which is all we wait for
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise ServerUnavailable(f"server did not answer at {url} within {timeout:.0f} s")


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str

    def storage_options(self) -> dict:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url},
        }

    def create_bucket(self, name: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        if not fs.exists(name):
            fs.mkdir(name)


@dataclass(frozen=True)
class GCSServer:
    endpoint_url: str
    #: the emulator's request log: one line per request, with its query string
    log_path: str

    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "test"}

    def create_bucket(self, name: str) -> None:
        import gcsfs

        fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options())
        if not fs.exists(name):
            fs.mkdir(name)


#: Azurite's one account and its key: published in Azurite's documentation, valid nowhere else
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
#: where ``npm ci --prefix .ci/node`` installs Azurite (README: Developing)
AZURITE_BIN = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ".ci",
    "node",
    "node_modules",
    ".bin",
    "azurite-blob",
)


@dataclass(frozen=True)
class AzuriteServer:
    endpoint_url: str  # the account's blob endpoint: http://127.0.0.1:<port>/devstoreaccount1
    #: Azurite's access log: one line per request
    log_path: str

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint_url};"
        )

    def storage_options(self) -> dict:
        return {"connection_string": self.connection_string}

    def create_container(self, name: str) -> None:
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        client = BlobServiceClient.from_connection_string(self.connection_string)
        with client, contextlib.suppress(ResourceExistsError):
            client.create_container(name)


def _spawn(argv: list[str], log_path: str = os.devnull, cwd: str | None = None) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server in its own process on a free port of 127.0.0.1."""
    port = free_port()
    proc = _spawn([_console_script("moto_server"), "-H", "127.0.0.1", "-p", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/moto-api/", proc, timeout=30)
        yield S3Server(url)
    finally:
        _stop(proc)


@contextlib.contextmanager
def gcs_server() -> Iterator[GCSServer]:
    """gcp-storage-emulator, in memory, in its own process on a free port of 127.0.0.1.

    Its request log is kept (``log_path``): the emulator accepts but ignores GCS preconditions,
    so tests read the log to check that a request carried one.
    """
    port = free_port()
    argv = [
        _console_script("gcp-storage-emulator"),
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--in-memory",
    ]
    log_dir = tempfile.mkdtemp(prefix="zephon-gcs-")
    log_path = os.path.join(log_dir, "requests.log")
    proc = _spawn(argv, log_path)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/storage/v1/b", proc, timeout=30)
        yield GCSServer(url, log_path)
    finally:
        _stop(proc)
        shutil.rmtree(log_dir, ignore_errors=True)


@contextlib.contextmanager
def azurite_server() -> Iterator[AzuriteServer]:
    """Azurite's blob service, in memory, in its own process on a free port of 127.0.0.1.

    Its access log is kept (``log_path``). ``--skipApiVersionCheck``: azure-storage-blob may
    speak a newer API version than the Azurite release knows; ``--loose`` lets it ignore
    headers it does not implement instead of refusing the request.
    """
    if shutil.which("node") is None:
        raise ServerUnavailable("Azurite needs Node.js (20 or newer) on PATH; install it")
    if not os.path.exists(AZURITE_BIN):
        raise ServerUnavailable(
            f"Azurite is not installed at {AZURITE_BIN}; install it with `npm ci --prefix .ci/node`"
        )
    port = free_port()
    work_dir = tempfile.mkdtemp(prefix="zephon-azurite-")
    log_path = os.path.join(work_dir, "requests.log")
    argv = [
        AZURITE_BIN,
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        str(port),
        "--inMemoryPersistence",
        "--skipApiVersionCheck",
        "--loose",
        "--disableTelemetry",
    ]
    proc = _spawn(argv, log_path, cwd=work_dir)  # in memory: nothing is written there
    try:
        url = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
        _wait_http(f"{url}?comp=list", proc, timeout=60)
        yield AzuriteServer(url, log_path)
    finally:
        _stop(proc)
        shutil.rmtree(work_dir, ignore_errors=True)


def postgres_url() -> str:
    """The PostgreSQL test database URL (``ZEPHON_TEST_POSTGRES_URL`` overrides the default)."""
    return os.environ.get("ZEPHON_TEST_POSTGRES_URL", POSTGRES_URL_DEFAULT)


def postgres_reachable(url: str) -> str | None:
    """None if ``url`` accepts a connection, else the reason it does not."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install -e '.[test]')"
    dsn = url.replace("postgresql+psycopg://", "postgresql://", 1)
    try:
        with psycopg.connect(dsn, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:  # any failure means "not reachable" to the caller
        return f"PostgreSQL at {dsn.split('@')[-1]} is not reachable: {exc}".strip()
    return None


def _libpq_dsn(url: str, database: str | None = None) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url).set(drivername="postgresql")
    if database is not None:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)


@contextlib.contextmanager
def postgres_database(server_url: str, prefix: str = "zephon_test") -> Iterator[str]:
    """A new, empty database on the server of ``server_url``, dropped afterwards; yields its
    SQLAlchemy URL. Other people use the same server at the same time: nothing shared is
    touched."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq_dsn(server_url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(_libpq_dsn(server_url), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
