"""``period_steps: auto``'s policy (``zephon.checkpointing.period``): the Young/Daly interval,
its conversion to steps, the MTBF from a run's attempts, the step time measured between
``should_save`` calls, and the checked ``auto_period`` options."""

from __future__ import annotations

import datetime as dt
import math

import pytest

from zephon.checkpointing.period import (
    AutoPeriod,
    PeriodPolicy,
    daly_interval_s,
    mtbf_from_starts,
    steps_for,
)
from zephon.config import CheckpointingConfig, load_job_config
from zephon.errors import ConfigError

T0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def test_a_cheap_save_follows_youngs_rule():
    young = math.sqrt(2 * 1.0 * 86400)
    assert daly_interval_s(1.0, 86400) == pytest.approx(young, rel=0.01)


def test_dalys_form_corrects_an_expensive_save_and_stops_at_the_mtbf():
    stall, mtbf = 600.0, 3600.0
    ratio = stall / (2 * mtbf)
    expected = math.sqrt(2 * stall * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - stall
    assert daly_interval_s(stall, mtbf) == pytest.approx(expected)
    assert daly_interval_s(7200.0, 3600.0) == 3600.0
    assert daly_interval_s(0.0, 3600.0) == 0.0


def test_the_interval_becomes_steps_within_the_bounds():
    bounds = AutoPeriod(min_steps=10, max_steps=1000)
    assert steps_for(120.0, 0.5, bounds) == 240
    assert steps_for(1.0, 0.5, bounds) == 10
    assert steps_for(1e6, 0.5, bounds) == 1000
    assert steps_for(5.0, 0.0, bounds) == 1000  # steps that take no time: save rarely


def test_the_mtbf_is_the_prior_until_the_run_has_a_history():
    assert mtbf_from_starts([], T0, 86400.0) == 86400.0
    # one attempt alive for 2 h: the prior plus the time survived
    assert mtbf_from_starts([T0], T0 + dt.timedelta(hours=2), 3600.0) == 3 * 3600.0
    # three attempts over 5 h (two failures): (5 h + 1 h prior) / 3
    starts = [T0, T0 + dt.timedelta(hours=1), T0 + dt.timedelta(hours=3)]
    assert mtbf_from_starts(starts, T0 + dt.timedelta(hours=5), 3600.0) == 2 * 3600.0


def test_the_step_time_leaves_out_the_saves_in_between():
    policy = PeriodPolicy(AutoPeriod(min_steps=2, max_steps=10_000))
    for step in (1, 2):
        policy.tick(step, 0.5 * step)
    assert policy.step_s == pytest.approx(0.5)
    policy.saved(2, 2.0)  # the save blocked 2 s between the ticks of steps 2 and 3
    policy.tick(3, 1.0 + 2.0 + 0.5)
    assert policy.step_s == pytest.approx(0.5)
    policy.tick(5, 3.5 + 2 * 0.8)  # two slower steps: the average moves towards them
    assert 0.5 < policy.step_s < 0.8


def test_the_first_period_is_the_minimum_then_the_measurements_decide():
    policy = PeriodPolicy(AutoPeriod(min_steps=5, max_steps=10_000))
    assert [s for s in range(1, 11) if policy.due(s, None)] == list(range(5, 11))
    assert policy.decide(3600.0) == 5  # nothing measured yet
    policy.tick(4, 0.0)
    policy.tick(5, 1.0)
    policy.saved(5, 2.0)
    expected = round(daly_interval_s(2.0, 3600.0) / 1.0)
    assert policy.decide(3600.0) == expected
    assert policy.adopt(expected) == f"save period 5 -> {expected} steps"
    assert policy.adopt(expected) is None
    assert not policy.due(5 + expected - 1, None)
    assert policy.due(5 + expected, None)
    assert policy.due(7, 7)  # the last step always saves


def test_a_resumed_job_counts_its_period_from_the_resume_step():
    policy = PeriodPolicy(AutoPeriod(min_steps=4, max_steps=100))
    policy.resumed(10)
    assert [s for s in range(11, 20) if policy.due(s, None)] == list(range(14, 20))
    assert "stall 0 s, step 0 s, MTBF 1.0 h" in policy.describe(3600.0)


# -- options -----------------------------------------------------------------------------------


def test_auto_is_a_period_and_auto_period_its_checked_options(tmp_path):
    config = CheckpointingConfig(
        save_dir=str(tmp_path),
        period_steps="auto",
        auto_period={"min_steps": 5, "max_steps": 50, "mtbf_s": 7200},
    )
    assert config.auto_period == AutoPeriod(5, 50, 7200.0)
    assert CheckpointingConfig(save_dir=str(tmp_path), period_steps="auto").auto_period == (
        AutoPeriod()
    )
    job = load_job_config(
        {
            "trainer": {
                "checkpointing": {
                    "save_dir": str(tmp_path),
                    "period_steps": "auto",
                    "auto_period": {"max_steps": 500},
                }
            }
        }
    )
    assert job.checkpointing.auto_period == AutoPeriod(max_steps=500)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_steps": 0}, r"auto_period\.min_steps = 0 is invalid: use an integer from 1"),
        ({"max_steps": "many"}, r"auto_period\.max_steps = 'many' is invalid"),
        ({"min_steps": 20, "max_steps": 10}, r"min_steps = 20 is invalid: use at most .*\(10\)"),
        ({"mtbf_s": 0.5}, r"auto_period\.mtbf_s = 0\.5 is invalid: use a number of seconds"),
        ({"mtbf_s": True}, r"auto_period\.mtbf_s = True is invalid"),
        ({"every": 3}, r"auto_period\.every is not a known setting; known: max_steps"),
        ([10, 100], r"auto_period = \[10, 100\] is invalid: use a mapping"),
    ],
)
def test_a_wrong_auto_period_is_one_line_naming_the_key(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message) as raised:
        CheckpointingConfig(save_dir=str(tmp_path), period_steps="auto", auto_period=options)
    assert "trainer.checkpointing.auto_period" in str(raised.value)
    assert len(str(raised.value).splitlines()) == 1


def test_auto_period_without_the_auto_period_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r'auto_period = .* is invalid: set period_steps: "auto"'):
        CheckpointingConfig(save_dir=str(tmp_path), period_steps=10, auto_period={})
