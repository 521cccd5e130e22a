"""Session-wide servers and backend fixtures shared by every layer's tests.

Under CI (``CI=true``) a server that cannot start is a failure, never a skip; on a developer
machine without one, the tests that need it skip with the reason.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from tests import servers
from tests.mounts import Mounts, MountUnavailable
from zephon.storage.backends import BACKEND_CLASSES, backend_for
from zephon.storage.backends import Backend as StorageBackend

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def random_payload(size: int) -> bytes:
    """Random bytes that do not end in a carriage return: gcp-storage-emulator drops a trailing
    ``\r`` from uploaded objects (seen here: b"abc\r" is stored as b"abc"), which a real GCS
    does not do and which Zephon's pre-commit check reports as a size mismatch."""
    data = os.urandom(size)
    return data[:-1] + b"." if data.endswith(b"\r") else data


def unavailable(reason: str) -> None:
    """Skip locally, fail under CI: CI must exercise every real backend."""
    if IN_CI:
        pytest.fail(f"required under CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    """Read-only bind mounts and small tmpfs disks (tests/mounts.py), unmounted after the
    test; without root it skips locally and fails under CI."""
    try:
        made = Mounts()
    except MountUnavailable as exc:
        unavailable(str(exc))
    try:
        yield made
    finally:
        made.unmount_all()


T = TypeVar("T")


def _serve(start: Callable[[], AbstractContextManager[T]]) -> Iterator[T]:
    """A server the tests start themselves, for the session; unavailable: skipped locally,
    failed under CI."""
    try:
        with start() as server:
            yield server
    except servers.ServerUnavailable as exc:
        unavailable(str(exc))


@pytest.fixture(scope="session")
def s3() -> Iterator[servers.S3Server]:
    yield from _serve(servers.s3_server)


@pytest.fixture(scope="session")
def gcs() -> Iterator[servers.GCSServer]:
    yield from _serve(servers.gcs_server)


@pytest.fixture(scope="session")
def azurite() -> Iterator[servers.AzuriteServer]:
    yield from _serve(servers.azurite_server)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    url = servers.postgres_url()
    reason = servers.postgres_reachable(url)
    if reason is not None:
        unavailable(reason)
    return url


@dataclass
class Backend:
    """A fresh, empty storage root on one backend: the URL plus its fsspec storage options."""

    name: str
    url: str
    storage_options: dict = field(default_factory=dict)
    #: False where the server accepts but ignores create-only preconditions (the GCS emulator);
    #: tests then check that the request carried the precondition instead of its effect.
    enforces_exclusive_create: bool = True
    gcs: servers.GCSServer | None = None
    #: keyword arguments for CheckpointStore on this backend
    store_kwargs: dict = field(default_factory=dict)

    def open_store(self, **kwargs):
        """A CheckpointStore on this backend's root."""
        from zephon.storage import CheckpointStore

        return CheckpointStore(self.url, self.storage_options, **{**self.store_kwargs, **kwargs})

    @property
    def bucket(self) -> str:
        return self.url.split("://", 1)[1].split("/", 1)[0]

    def create_only_requests(self) -> list[str]:
        """GCS only: the emulator's logged requests on this bucket that carried
        ``ifGenerationMatch=0``."""
        assert self.gcs is not None, "only the GCS backend keeps a request log"
        with open(self.gcs.log_path, errors="replace") as log:
            return [
                line
                for line in log
                if f"/b/{self.bucket}/o" in line and "ifGenerationMatch=0" in line
            ]


#: the protocol of each test backend's root (``make_backend``); every registered backend class
#: needs one (tests/storage/test_backend_conformance.py checks)
TEST_PROTOCOLS = {"local": "file", "memory": "memory", "s3": "s3", "gcs": "gs", "azure": "az"}
#: test backends whose server accepts but ignores create-only preconditions (the GCS emulator)
PRECONDITIONS_IGNORED = frozenset({"gcs"})
#: test backends whose server refuses a create-only write to an existing object but checks and
#: stores without a lock, so two creates racing through that window can both succeed: moto's
#: S3 (``If-None-Match: *`` is a lookup, then a put). Real S3 decides it atomically.
PRECONDITIONS_RACY = frozenset({"s3"})


def backend_class(name: str) -> type[StorageBackend]:
    """The storage backend class a test backend's root opens with."""
    return backend_for(TEST_PROTOCOLS[name])


def backends_with(*, one_winner_races: bool | None = None, **flags: bool) -> list[str]:
    """The test backends whose class has every capability flag given (e.g.
    ``exclusive_create=True``, ``cross_process=True``), in registry order.
    ``one_winner_races=True`` keeps those where a marker race really has exactly one winner
    here: an exclusive class whose test server enforces the precondition."""
    chosen = []
    for name in BACKENDS:
        cls = backend_class(name)
        if any(getattr(cls, flag) != value for flag, value in flags.items()):
            continue
        one_winner = cls.exclusive_create and name not in PRECONDITIONS_IGNORED
        if one_winner_races is not None and one_winner != one_winner_races:
            continue
        chosen.append(name)
    return chosen


#: one test backend per registered backend class, in registry order
BACKENDS = [
    name
    for cls in BACKEND_CLASSES
    for name, protocol in TEST_PROTOCOLS.items()
    if backend_for(protocol) is cls
]
#: local disk and an object store: for suites whose code takes one path or the other
DISK_AND_OBJECT_STORE = [
    backends_with(posix_paths=True)[0],
    backends_with(server_side_prefix=True)[0],
]


def make_backend(name: str, request: pytest.FixtureRequest, tmp_path) -> Backend:
    unique = uuid.uuid4().hex[:12]
    if name == "local":
        return Backend("local", str(tmp_path / "ckpt"))
    if name == "memory":
        return Backend("memory", f"memory://zephon-test-{unique}")
    if name == "s3":
        server: servers.S3Server = request.getfixturevalue("s3")
        bucket = f"zt-{unique}"
        server.create_bucket(bucket)
        return Backend("s3", f"s3://{bucket}/ckpt", server.storage_options())
    if name == "gcs":
        server_g: servers.GCSServer = request.getfixturevalue("gcs")
        bucket = f"zt-{unique}"
        server_g.create_bucket(bucket)
        return Backend(
            "gcs",
            f"gs://{bucket}/ckpt",
            server_g.storage_options(),
            enforces_exclusive_create=False,
            gcs=server_g,
        )
    if name == "azure":
        server_a: servers.AzuriteServer = request.getfixturevalue("azurite")
        container = f"zt-{unique}"
        server_a.create_container(container)
        return Backend("azure", f"az://{container}/ckpt", server_a.storage_options())
    raise ValueError(f"unknown backend {name!r}")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    """Every storage backend in turn: the conformance suites take this fixture."""
    return make_backend(request.param, request, tmp_path)


@pytest.fixture
def s3_backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    return make_backend("s3", request, tmp_path)


@pytest.fixture
def azure_backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    return make_backend("azure", request, tmp_path)


@pytest.fixture
def local_backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    return make_backend("local", request, tmp_path)


# -- catalogs ------------------------------------------------------------------------------


@contextlib.contextmanager
def database_url(backend: str, request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh, empty catalog database: a SQLite file, or a PostgreSQL database of its own."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / f'catalog-{uuid.uuid4().hex[:8]}.db'}"
        return
    server = request.getfixturevalue("postgres_url")
    with servers.postgres_database(server) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """The URL of a fresh, empty catalog database on each backend in turn."""
    with database_url(request.param, request, tmp_path) as url:
        yield url


@pytest.fixture
def catalog(catalog_url: str):
    """An open catalog at schema head on each backend in turn."""
    from zephon.catalog import Catalog

    with Catalog(catalog_url) as opened:
        yield opened
