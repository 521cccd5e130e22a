"""What a quick command imports: ``import zephon``, its layers and the ``zephon`` parser load
none of the heavy packages, ``zephon latest`` on a SQLite catalog loads none either (the
catalog's answer is read through the stdlib ``sqlite3``: ``catalog.lookup``), and on
PostgreSQL SQLAlchemy's Core without its ORM or Zephon's models. Each case runs in a fresh
process and reads ``sys.modules``: no timing here (benchmarks/cli_startup.py measures).

Also: ``HEAD_REVISION``, which lets opening a catalog skip Alembic, is the migrations' head.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from tests.zephon.saves import save_step, start
from zephon import catalog as catalog_layer
from zephon import storage
from zephon.catalog import Catalog, schema
from zephon.locations import run_location

#: packages no quick command needs (import names; a submodule counts as its package)
HEAVY = (
    "sqlalchemy",
    "alembic",
    "torch",
    "numpy",
    "fsspec",
    "s3fs",
    "gcsfs",
    "adlfs",
    "azure",
    "aiohttp",
    "botocore",
    "aiobotocore",
    "rich",
    "yaml",
    "google_crc32c",
    "crc32c",
)

_REPORT = (
    "import atexit, json, sys\n"
    "atexit.register(lambda: print('\\nLOADED', json.dumps(sorted(sys.modules))))\n"
)


#: modules that only the full catalog (``Catalog``: the ORM and the models) needs
ORM = ("sqlalchemy.orm", "zephon.catalog.models", "zephon.catalog.catalog")


def loaded_by(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The heavy packages in ``sys.modules`` when a fresh interpreter has run ``code``."""
    return {module.split(".")[0] for module in modules_of(code, env)} & set(HEAVY)


def modules_of(code: str, env: dict[str, str] | None = None) -> set[str]:
    """Every module in ``sys.modules`` when a fresh interpreter has run ``code``."""
    done = subprocess.run(
        [sys.executable, "-c", _REPORT + code],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("LOADED ")]
    assert lines, f"the probe failed ({done.returncode}): {done.stderr}"
    return set(json.loads(lines[-1][len("LOADED ") :]))


@pytest.mark.parametrize(
    "code",
    [
        "import zephon",
        "import zephon.storage",
        "import zephon.catalog",
        "from zephon.storage import StorageError, CheckpointNotFoundError, validate_run, redact",
        "from zephon.catalog import CatalogError, RunNotFoundError, CheckpointState",
        "from zephon.catalog import latest_alone, PROBED_STATES",
        "from zephon import ZephonError, CatalogError, StorageError, CheckpointNotFoundError",
        "from zephon.cli import build_parser; build_parser().parse_args(['latest', 'r'])",
    ],
)
def test_importing_zephon_and_parsing_a_command_loads_nothing_heavy(code):
    assert loaded_by(code) == set()


def test_help_loads_nothing_heavy():
    code = (
        "import contextlib, io\n"
        "from zephon.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "    main(['latest', '--help'])\n"
    )
    assert loaded_by(code) == set()


def _latest(run: str) -> str:
    return (
        "import sys\n"
        "from zephon.cli import main\n"
        f"code = main(['latest', {run!r}])\n"
        "assert code == 0, code\n"
    )


def _saved_run(catalog: Catalog, backend, name: str) -> None:
    store = backend.open_store()
    record = catalog.ensure_run(name, store.location.canonical_url)
    location = run_location(record, backend.storage_options)
    attempt = start(location, catalog)
    for step in (10, 20):
        save_step(attempt, step, catalog)


def test_latest_on_a_sqlite_catalog_loads_nothing_heavy(tmp_path, local_backend):
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog(url) as catalog:
        _saved_run(catalog, local_backend, "r")
    assert loaded_by(_latest("r"), {"ZEPHON_CATALOG_URL": url}) == set()


def test_latest_on_postgresql_loads_sqlalchemy_core_without_the_orm(postgres_url, local_backend):
    from tests.servers import postgres_database

    with postgres_database(postgres_url) as url:
        with Catalog(url) as catalog:
            _saved_run(catalog, local_backend, "r")
        loaded = modules_of(_latest("r"), {"ZEPHON_CATALOG_URL": url})
    assert {"sqlalchemy", "zephon.catalog.lookup"} <= loaded
    assert loaded & set(ORM) == set()
    assert {m.split(".")[0] for m in loaded} & set(HEAVY) == {"sqlalchemy"}


def test_latest_of_an_s3_run_imports_no_storage_backend(tmp_path, s3_backend):
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog(url) as catalog:
        _saved_run(catalog, s3_backend, "r")
    env = {
        "ZEPHON_CATALOG_URL": url,
        "ZEPHON_STORAGE_OPTIONS": json.dumps(s3_backend.storage_options),
    }
    assert loaded_by(_latest("r"), env) == set()
    # --check reads the marker: then the backend and the full catalog are loaded
    checked = modules_of(_latest("r").replace("'latest', ", "'latest', '--check', "), env)
    assert {"fsspec", "s3fs", *ORM} <= checked


def test_the_head_revision_constant_is_the_head_of_the_migrations():
    """Opening a catalog compares the stored revision with ``HEAD_REVISION`` without Alembic:
    a new migration must move it."""
    head = schema.scripts_head()
    assert head == schema.HEAD_REVISION, (
        f"migrations/versions has a new head {head!r}: "
        "set HEAD_REVISION in catalog/revision.py to it"
    )
    assert catalog_layer.head_revision() == head


@pytest.mark.parametrize("layer", [storage, catalog_layer], ids=lambda m: m.__name__)
def test_every_lazy_name_is_the_defining_modules_object(layer):
    for name in layer.__all__:
        value = getattr(layer, name)
        assert not isinstance(value, types.ModuleType), name  # a submodule shadowing a name
    for name, module in layer._LAZY.items():
        assert getattr(layer, name) is getattr(sys.modules[module], name), name
