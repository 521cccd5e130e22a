"""A resume chooses ahead of its claim (``zephon.attempts.Registration``) and loads while the
claim, the confirmed choice and the decision are written. Every window the order claim,
choice, decision used to close is held open here, in one process, on local disk and S3 (moto)
with a SQLite or PostgreSQL catalog: the older attempt commits, or retention deletes, or
another start claims, between the choice made ahead and the claim."""

from __future__ import annotations

import pytest

from tests.conftest import DISK_AND_OBJECT_STORE, make_backend
from tests.zephon.saves import save_step, start
from tests.zephon.test_composition import make_run
from zephon import ZephonError
from zephon.attempts import Registration, register
from zephon.latest import find_latest
from zephon.storage import Lineage


@pytest.fixture(params=DISK_AND_OBJECT_STORE)
def store_backend(request, tmp_path):
    return make_backend(request.param, request, tmp_path)


def chooser(location, catalog):
    """The resume's own rule: the run's latest complete checkpoint of the lineage."""

    def choose(lineage: Lineage) -> tuple[int | None, None]:
        latest = find_latest(location, catalog=catalog, lineage=lineage)
        return (latest.step if latest is not None else None), None

    return choose


def chosen_ahead(catalog, store_backend, steps):
    """A run whose first attempt committed ``steps``, and a second start that read the
    lineage and chose ahead: (location, the first attempt, the registration, its choice, the
    rule)."""
    location = make_run(catalog, store_backend)
    old = start(location, catalog)
    for step in steps:
        save_step(old, step, catalog)
    registration = Registration.begin(location, catalog)
    choose = chooser(location, catalog)
    chosen, _ = choose(registration.lineage)
    return location, old, registration, chosen, choose


def test_a_choice_nothing_moved_is_decided_as_made(catalog, store_backend):
    location, old, registration, chosen, choose = chosen_ahead(catalog, store_backend, [10])
    assert chosen == 10
    attempt, stands = registration.decide_in_background(chosen, choose).wait()
    assert stands and attempt.resumed_from == 10
    assert attempt.epoch == registration.lineage.epoch == old.epoch + 1
    assert location.runstore.lineage().current == attempt.record
    assert catalog.current_attempt("r").epoch == attempt.epoch


def test_a_step_the_older_attempt_commits_before_the_claim_is_chosen_instead(
    catalog, store_backend
):
    location, old, registration, chosen, choose = chosen_ahead(catalog, store_backend, [10])
    save_step(old, 20, catalog)  # still unfenced: the claim has not landed
    attempt, stands = registration.decide_in_background(chosen, choose).wait()
    # claim first, then choice: 20 was committed before the older attempt was fenced out, so
    # it is the history the new attempt continues, not one its decision abandons
    assert not stands and attempt.resumed_from == 20
    assert location.runstore.lineage().admits(old.epoch, 20)


def test_a_step_the_older_attempt_deletes_before_the_claim_is_not_decided(catalog, store_backend):
    location, _, registration, chosen, choose = chosen_ahead(catalog, store_backend, [10, 20])
    assert chosen == 20
    location.runstore.delete(20)  # as the older attempt's retention or a gc would
    catalog.mark_missing("r", 20)
    attempt, stands = registration.decide_in_background(chosen, choose).wait()
    assert not stands and attempt.resumed_from == 10


def test_another_start_claiming_first_is_fenced_out_by_a_second_claim(catalog, store_backend):
    location, _, registration, chosen, choose = chosen_ahead(catalog, store_backend, [10])
    other = register(location, catalog, lineage=location.runstore.lineage(), resumed_from=10)
    attempt, stands = registration.decide_in_background(chosen, choose).wait()
    assert stands and attempt.resumed_from == 10
    assert attempt.epoch == other.epoch + 1
    assert location.runstore.lineage().current == attempt.record


def test_a_loaded_step_another_start_abandoned_stops_the_job(catalog, store_backend):
    location, _, registration, chosen, choose = chosen_ahead(catalog, store_backend, [10])
    # another start of the run claims first and starts afresh: step 10 leaves the history
    register(location, catalog, lineage=location.runstore.lineage(), resumed_from=None)
    pending = registration.decide_in_background(chosen, choose)
    with pytest.raises(ZephonError, match="step 10 left the run's history .* restart the job"):
        pending.wait()


def test_a_fresh_start_chosen_ahead_sees_a_step_committed_before_the_claim(catalog, store_backend):
    _, old, registration, chosen, choose = chosen_ahead(catalog, store_backend, [])
    assert chosen is None
    save_step(old, 10, catalog)
    attempt, stands = registration.decide_in_background(chosen, choose).wait()
    assert not stands and attempt.resumed_from == 10


def test_an_abandoned_registration_is_no_longer_a_claim_under_way(catalog, store_backend):
    """A registration the load stopped before writing (or a read-ahead left unused) leaves
    the process's set of unwritten claims: no lineage can ever be headed by it."""
    from zephon import attempts

    _, _, registration, _, _ = chosen_ahead(catalog, store_backend, [10])
    assert registration.attempt_id in attempts._UNWRITTEN
    registration.abandon()
    assert registration.attempt_id not in attempts._UNWRITTEN
