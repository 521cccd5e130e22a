"""The dashboard's goodput from per-attempt aggregates (``Catalog.save_summaries``) is the
figure ``zephon.goodput.compute`` gives over every row, on real runs and on restart
histories written through the catalog on both backends; and the runs page's cache of those
figures follows the catalog."""

from __future__ import annotations

import pytest

from tests.catalog.conftest import commit_step, register
from zephon.catalog import Catalog
from zephon.goodput import AttemptSpan, SaveSpan, compute
from zephon.ui.figures import GoodputCache
from zephon.ui.views import goodput_of

FIELDS = ("wall_s", "productive_s", "lost_s", "overhead_s", "stall_s", "restarts", "attempts")


def over_rows(catalog: Catalog, name: str) -> dict:
    """``compute`` over every checkpoint row, the attempts as ``goodput_of`` takes them; each
    row's stall read from its JSON timings (the run page's read), not from the stall column
    that ``save_summaries`` sums, so the two are checked against each other too."""
    record = catalog.get_run(name)
    attempts = [
        AttemptSpan(
            a.epoch, min(a.started_at, a.registered_at), a.registered_at, a.resumed_from, a.decided
        )
        for a in catalog.list_attempts(name)
    ]
    rows, _ = catalog.timeline(name)
    if not attempts:
        first = min([record.created_at, *(r.created_at for r in rows)])
        attempts = [AttemptSpan(0, first, first, None)]
    saves = [
        SaveSpan(r.step, r.epoch, r.created_at, r.committed_at, r.timings.get("stall_s", 0.0))
        for r in rows
    ]
    ended = record.updated_at if record.status == "finished" else None
    return compute(name, attempts, saves, ended_at=ended).to_dict()


def from_aggregates(catalog: Catalog, name: str) -> dict:
    record = catalog.get_run(name)
    return goodput_of(record, catalog.list_attempts(name), catalog.save_summaries([name])[name])


def assert_same(catalog: Catalog, name: str) -> dict:
    exact, aggregated = over_rows(catalog, name), from_aggregates(catalog, name)
    for field in FIELDS:
        assert aggregated[field] == pytest.approx(exact[field], abs=2e-3), (field, exact)
    return aggregated


def test_the_filled_runs_figures_equal_compute_over_their_rows(filled):
    url, _ = filled
    with Catalog(url, read_only=True) as catalog:
        alpha = assert_same(catalog, "alpha")
        assert alpha["restarts"] == 3  # (its lost time may round to 0 on a loaded machine)
        assert assert_same(catalog, "beta")["restarts"] == 0


def _stall(catalog: Catalog, run: str, step: int, seconds: float) -> None:
    catalog.add_timings(run, step, catalog.get_checkpoint(run, step).save_id, {"stall_s": seconds})


@pytest.mark.parametrize(
    "history",
    [
        # (epoch, resumed_from, steps it saves): a restart from the last save, one from an
        # older save (work lost), a fresh start after all, and a run never fenced
        [(1, None, [1, 2, 3]), (2, 3, [4, 5])],
        [(1, None, [1, 2, 3, 4]), (2, 2, [3, 4, 5]), (3, 4, [6])],
        [(1, None, [1, 2]), (2, None, [1, 2, 3])],
        [(0, None, [1, 2, 3])],
    ],
)
def test_restart_histories_give_the_figures_of_compute_over_rows(catalog_url, history):
    with Catalog(catalog_url) as catalog:
        catalog.ensure_run("r", "memory://ckpt/r")
        for epoch, resumed_from, steps in history:
            if epoch:
                register(catalog, "r", epoch, resumed_from)
            for step in steps:
                commit_step(catalog, "r", step, epoch=epoch)
                _stall(catalog, "r", step, 0.01 * step)
        figures = assert_same(catalog, "r")
    assert figures["stall_s"] > 0


def test_the_cache_follows_the_catalog(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    with Catalog(url) as catalog:
        catalog.ensure_run("r", "memory://ckpt/r")
        commit_step(catalog, "r", 1)
        _stall(catalog, "r", 1, 0.5)
        cache = GoodputCache(catalog)
        first = cache.figures(catalog.run_page().runs)["r"]
        assert first == from_aggregates(catalog, "r")
        _stall(catalog, "r", 1, 0.75)  # touches no key: kept until max_age_s
        assert cache.figures(catalog.run_page().runs)["r"] is first
        commit_step(catalog, "r", 2)  # a new save: computed again
        second = cache.figures(catalog.run_page().runs)["r"]
        assert second is not first and second == from_aggregates(catalog, "r")
        fresh = GoodputCache(catalog, max_age_s=0)
        assert fresh.warm() == 1
        assert fresh.figures(catalog.run_page().runs)["r"] == second
