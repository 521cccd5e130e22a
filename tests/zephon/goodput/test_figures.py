"""``zephon.goodput.compute`` on hand-built records: exact figures for the cases docs/goodput.md
defines, and hypothesis for the invariants (the parts add up to the wall time, none below 0)."""

from __future__ import annotations

import datetime as dt
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.goodput import AttemptSpan, SaveSpan, compute

T0 = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def attempt(epoch, started, progress, resumed_from=None, decided=True) -> AttemptSpan:
    return AttemptSpan(epoch, at(started), at(progress), resumed_from, decided)


def save(step, epoch, created, committed=None, stall=0.0) -> SaveSpan:
    return SaveSpan(step, epoch, at(created), None if committed is None else at(committed), stall)


def figures(result) -> tuple[float, ...]:
    return tuple(
        round(v, 6)
        for v in (result.wall_s, result.productive_s, result.lost_s, result.overhead_s,
                  result.stall_s)
    )  # fmt: skip


def test_one_attempt_start_up_is_overhead_saves_are_stall():
    result = compute(
        "r",
        [attempt(1, 0, 10)],
        [save(10, 1, 100, 102, stall=2.0), save(20, 1, 200, 203, stall=3.0)],
    )
    # wall, productive, lost, overhead, stall
    assert figures(result) == (203, 188, 0, 10, 5)
    assert (result.attempts, result.restarts) == (1, 0)
    assert result.goodput == pytest.approx(188 / 203)


def test_a_restart_redoes_the_work_after_the_checkpoint_it_resumed_from():
    attempts = [attempt(1, 0, 10), attempt(2, 250, 260, resumed_from=10)]
    saves = [
        save(10, 1, 100, 102, stall=2.0),
        save(20, 1, 200),  # begun, never committed: the attempt died in it
        save(20, 2, 360, 361, stall=1.0),  # the second attempt's save of the same step
    ]
    result = compute("r", attempts, saves)
    # attempt 1: 10..200, its work after step 10's save (at 100) lost, less that save's stall;
    # overhead: 0..10, then 200..260
    assert figures(result) == (361, 190, 98, 70, 3)
    assert (result.attempts, result.restarts) == (2, 1)


def test_a_fresh_restart_loses_everything_before_it():
    attempts = [attempt(1, 0, 10), attempt(2, 250, 260, resumed_from=None)]
    saves = [save(10, 1, 100, 102, stall=2.0), save(5, 2, 300, 301, stall=1.0)]
    assert figures(compute("r", attempts, saves)) == (301, 40, 90, 168, 3)


def test_a_deeper_rollback_later_loses_what_an_earlier_resume_kept():
    attempts = [
        attempt(1, 0, 0),
        attempt(2, 300, 300, resumed_from=20),
        attempt(3, 500, 500, resumed_from=10),  # step 20 found damaged: back to 10
    ]
    saves = [save(10, 1, 100, 101), save(20, 1, 200, 201), save(30, 2, 400, 401)]
    result = compute("r", attempts, saves)
    # attempt 1 keeps 0..100 (step 10), attempt 2 keeps nothing, attempt 3 is the last
    assert figures(result) == (500, 100, 202, 198, 0)


def test_an_undecided_attempt_discards_nothing():
    attempts = [attempt(1, 0, 0), attempt(2, 300, 300, decided=False)]
    result = compute("r", attempts, [save(10, 1, 100, 101)])
    assert result.lost_s == 0
    assert figures(result) == (300, 101, 0, 199, 0)


def test_a_finished_run_ends_at_its_end_not_its_last_save():
    result = compute("r", [attempt(1, 0, 0)], [save(10, 1, 100, 101)], ended_at=at(150))
    assert figures(result) == (150, 150, 0, 0, 0)
    assert result.ended_at == at(150)


def test_a_run_without_attempts_has_nothing_to_report():
    result = compute("r", [], [])
    assert figures(result) == (0, 0, 0, 0, 0)
    assert result.goodput == 1.0
    assert result.to_dict()["started_at"] is None


def test_an_old_attempt_still_saving_after_the_next_began_is_cut_off():
    # attempt 1 went on after attempt 2 took over (its saves were refused by then): its time
    # ends where attempt 2's progress begins (110), its save at 150 is not counted
    attempts = [attempt(1, 0, 0), attempt(2, 100, 110, resumed_from=10)]
    saves = [save(10, 1, 50, 51), save(20, 1, 150, 151, stall=9.0), save(20, 2, 200, 201)]
    result = compute("r", attempts, saves)
    assert figures(result) == (201, 50 + 91, 60, 0, 0)


def test_to_dict_is_json_ready():
    result = compute("r", [attempt(1, 0, 0)], [save(10, 1, 100, 101, stall=1.0)])
    values = result.to_dict()
    assert values["started_at"] == T0.isoformat()
    assert values["goodput"] == pytest.approx(100 / 101)
    assert set(values) >= {"wall_s", "productive_s", "lost_s", "overhead_s", "stall_s"}


# -- invariants --------------------------------------------------------------------------------

seconds = st.floats(min_value=0, max_value=10_000, allow_nan=False)


@st.composite
def runs(draw):
    count = draw(st.integers(min_value=1, max_value=5))
    epochs = sorted(draw(st.sets(st.integers(1, 50), min_size=count, max_size=count)))
    attempts = [
        AttemptSpan(
            e,
            at(draw(seconds)),
            at(draw(seconds)),
            draw(st.none() | st.integers(0, 100)),
            draw(st.booleans()),
        )
        for e in epochs
    ]
    saves = [
        SaveSpan(
            draw(st.integers(0, 100)),
            draw(st.integers(0, 60)),
            at(draw(seconds)),
            draw(st.none() | seconds.map(at)),
            draw(st.floats(min_value=0, max_value=5_000, allow_nan=False)),
        )
        for _ in range(draw(st.integers(0, 12)))
    ]
    ended = draw(st.none() | seconds.map(at))
    return attempts, saves, ended


@settings(max_examples=300, deadline=None)
@given(runs())
def test_the_parts_add_up_to_the_wall_time_and_none_is_negative(run):
    attempts, saves, ended = run
    result = compute("r", attempts, saves, ended_at=ended)
    parts = (result.productive_s, result.lost_s, result.overhead_s, result.stall_s)
    assert all(part >= 0 for part in parts)
    assert math.isclose(sum(parts), result.wall_s, rel_tol=1e-9, abs_tol=1e-6)
    assert 0.0 <= result.goodput <= 1.0 + 1e-9
    assert result.restarts == len(attempts) - 1


def test_records_that_disagree_never_make_a_part_negative():
    # a stall longer than the time to the next save (clocks of two hosts, a timing merged
    # late): stall and lost are cut to the attempt's span, productive stays at 0
    attempts = [attempt(1, 0, 0), attempt(2, 150, 150, resumed_from=10)]
    saves = [save(5, 1, 5, 6, stall=80.0), save(10, 1, 50, 51), save(20, 1, 100)]
    result = compute("r", attempts, saves)
    assert figures(result) == (150, 0, 20, 50, 80)
