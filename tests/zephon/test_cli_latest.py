"""``zephon latest RUN`` through the catalog's lookup without the ORM (``catalog.latest_alone``)
answers exactly when the full lookup (``zephon.latest.find_latest``) answers without storage,
with the same checkpoint, on SQLite and PostgreSQL, after real saves on storage: crashes around
the marker, attempts that resumed earlier or have not decided, a run with no checkpoint, one
the catalog never saw. And a schema not at head still gives the catalog's one-line error.

On SQLite only, the command's own catalog: tests/catalog/test_lookup.py compares both backends'
answers with the ORM's across every row state."""

from __future__ import annotations

import pytest

from tests.catalog.conftest import execute_sql
from tests.zephon.saves import crash_after_marker, crash_before_marker, save_step, start
from tests.zephon.test_composition import make_run
from zephon.attempts import claim
from zephon.catalog import Catalog, latest_alone
from zephon.latest import find_latest
from zephon.locations import RunLocation
from zephon.storage import CheckpointStore


def _saved(catalog, backend):
    location = make_run(catalog, backend)
    attempt = start(location, catalog)
    for step in (10, 20):
        save_step(attempt, step, catalog)
    return location, attempt


def _committed(catalog, backend):
    _saved(catalog, backend)


def _marker_written_catalog_not_told(catalog, backend):
    _, attempt = _saved(catalog, backend)
    crash_after_marker(attempt, catalog, 30)  # the full lookup promotes 30


def _died_before_its_marker(catalog, backend):
    _, attempt = _saved(catalog, backend)
    crash_before_marker(attempt, catalog, 30)


def _resumed_from_an_earlier_step(catalog, backend):
    location, _ = _saved(catalog, backend)
    start(location, catalog, resumed_from=10)  # 20 is abandoned


def _a_start_deciding_now(catalog, backend):
    location, _ = _saved(catalog, backend)
    claim(location, catalog, location.runstore.lineage())  # fenced, not decided


def _no_checkpoint(catalog, backend):
    start(make_run(catalog, backend), catalog)


def _never_seen(catalog, backend):
    make_run(catalog, backend, name="other")


SCENARIOS = {
    "committed": (_committed, 20),
    "marker written, catalog not told": (_marker_written_catalog_not_told, None),
    "died before its marker": (_died_before_its_marker, None),
    "resumed from an earlier step": (_resumed_from_an_earlier_step, 10),
    "a start deciding now": (_a_start_deciding_now, None),
    "no checkpoint": (_no_checkpoint, "none"),
    "a run the catalog never saw": (_never_seen, None),
}


def _tracked(catalog: Catalog, backend, opened: list[str]) -> RunLocation:
    """Run ``r``'s location, its store opened (and noted in ``opened``) on first use only."""
    record = catalog.get_run("r")

    def open_store() -> CheckpointStore:
        opened.append(record.storage_url)
        return CheckpointStore(record.storage_url, backend.storage_options)

    return RunLocation.deferred("r", open_store, "r")


SQLITE = pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)


@SQLITE
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_latest_without_the_orm_answers_as_the_full_lookup_does_without_storage(
    cli, catalog, catalog_url, local_backend, scenario
):
    build, expected = SCENARIOS[scenario]
    build(catalog, local_backend)
    quick = latest_alone(catalog_url, "r")  # read-only: the full lookup still sees the same
    assert (quick and (quick.step or "none")) == expected
    if scenario == "a run the catalog never saw":
        code, out, _ = cli("latest", "r")
        assert quick is None and code == 1 and "is not in catalog" in out
        return
    opened: list[str] = []
    full = find_latest(_tracked(catalog, local_backend, opened), catalog=catalog)
    code, out, _ = cli("latest", "r")  # after: the full lookup may have repaired a row
    # the catalog's lookup answers exactly when the full one needed no storage ...
    assert (quick is not None) == (not opened)
    # ... with the same checkpoint, and the command prints it
    if quick is not None:
        assert (quick.step, quick.path) == ((full.step, full.url) if full else (None, None))
        assert quick.save_id == (full.save_id if full else None)
    if full is None:
        assert (code, out) == (1, "no complete checkpoint for run r\n")
    else:
        assert (code, out) == (0, full.url + "\n")


@SQLITE
@pytest.mark.parametrize("revision", ["0123456789ab", None])
def test_a_schema_not_at_head_gives_the_catalogs_one_line_error(
    cli, catalog, catalog_url, local_backend, revision
):
    _committed(catalog, local_backend)
    if revision is None:
        execute_sql(catalog_url, "DELETE FROM alembic_version")
    else:
        execute_sql(catalog_url, f"UPDATE alembic_version SET version_num = '{revision}'")
    code, out, err = cli("latest", "r")
    assert (code, out) == (5, "") and err.count("\n") == 1
    assert err.startswith("zephon: error: ") and "schema" in err.lower()
    if revision:
        assert revision in err
