"""One rule per value, wherever it is checked: storage and the catalog accept exactly the same
run names, the job config refuses what a catalog column cannot hold, and a manager refuses a
bad run name before anything is registered."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.catalog import Catalog, InvalidValueError
from zephon.catalog import validate as catalog_validate
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig, load_job_config
from zephon.errors import ConfigError
from zephon.locations import RETRY_ENV, retry_from_env
from zephon.storage import InvalidNameError, RetryPolicy, validate_run

NAMES = st.one_of(
    st.text(alphabet=string.ascii_letters + string.digits + "._-/ \\~ü\n", max_size=140),
    st.sampled_from(["save-5", "save-05", "save-", "_attempts", ".", "..", "a" * 128, "a" * 129]),
    st.from_regex(r"save-(0|[1-9][0-9]{0,5})", fullmatch=True),
)


def accepts(check, name) -> bool:
    try:
        check(name)
    except (InvalidNameError, InvalidValueError):
        return False
    return True


@settings(max_examples=400, derandomize=True, deadline=None)
@given(NAMES)
def test_storage_and_the_catalog_accept_exactly_the_same_run_names(name):
    assert accepts(validate_run, name) == accepts(catalog_validate.run_name, name), name


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_to_keep", 10**30),
        ("num_to_keep", 2**31),
        ("keep_every_steps", 2**63),
        ("period_steps", 2**63),
        ("num_to_keep", 0),
        ("num_to_keep", True),
    ],
)
def test_the_config_refuses_what_a_catalog_column_cannot_hold(tmp_path, field, value):
    with pytest.raises(ConfigError, match=f"trainer.checkpointing.{field} = "):
        CheckpointingConfig(save_dir=str(tmp_path), **{field: value})


@pytest.mark.parametrize("name", ["", "save-5", "a/b", "_attempts"])
def test_a_bad_run_name_is_refused_before_anything_is_registered(tmp_path, name):
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = CheckpointingConfig(save_dir=str(tmp_path / "ckpt"), catalog_url=url)
    with pytest.raises(ConfigError, match="run_name: invalid run name"):
        CheckpointManager(config, run_name=name, total_steps=10)
    with Catalog(url) as catalog:
        assert catalog.list_runs() == []


@pytest.mark.parametrize("total", [0, -1, 2**63, 1.5])
def test_total_steps_must_be_a_step_a_catalog_can_hold(tmp_path, total):
    config = CheckpointingConfig(save_dir=str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match="total_steps"):
        CheckpointManager(config, run_name="r", total_steps=total)


# -- the retry policy (trainer.checkpointing.retry, $ZEPHON_RETRY) -----------------------------


def test_a_jobs_retry_settings_reach_the_store_it_opens(tmp_path):
    config = load_job_config(
        {
            "trainer": {
                "checkpointing": {
                    "save_dir": str(tmp_path / "ckpt"),
                    "retry": {"max_attempts": 5, "deadline_s": 30},
                }
            }
        }
    )
    assert config.checkpointing.retry == RetryPolicy(max_attempts=5, deadline_s=30)
    with CheckpointManager(config.checkpointing, run_name="r", total_steps=2) as manager:
        assert manager.store.location.retry == RetryPolicy(max_attempts=5, deadline_s=30)
    assert CheckpointingConfig(save_dir=str(tmp_path)).retry == RetryPolicy()


@pytest.mark.parametrize(
    ("retry", "message"),
    [
        ({"max_attempts": 0}, r"trainer.checkpointing.retry is invalid: RetryPolicy max_attempts"),
        ({"deadline_s": "long"}, r"trainer.checkpointing.retry is invalid: .*deadline_s"),
        ({"attempts": 3}, r"trainer.checkpointing.retry.attempts is not a known setting; known"),
        (5, r"trainer.checkpointing.retry = 5 is invalid: use a mapping of max_attempts"),
    ],
)
def test_retry_settings_out_of_range_are_refused_in_one_line(tmp_path, retry, message):
    with pytest.raises(ConfigError, match=message) as caught:
        CheckpointingConfig(save_dir=str(tmp_path), retry=retry)
    assert "\n" not in str(caught.value)


def test_the_cli_takes_its_retry_policy_from_the_environment(monkeypatch):
    monkeypatch.delenv(RETRY_ENV, raising=False)
    assert retry_from_env() == RetryPolicy()
    monkeypatch.setenv(RETRY_ENV, '{"deadline_s": 10}')
    assert retry_from_env() == RetryPolicy(deadline_s=10)
    monkeypatch.setenv(RETRY_ENV, "{nope")
    with pytest.raises(ConfigError, match=r"\$ZEPHON_RETRY is not valid JSON"):
        retry_from_env()
    monkeypatch.setenv(RETRY_ENV, '{"jitter": 3}')
    with pytest.raises(ConfigError, match=r"\$ZEPHON_RETRY is invalid: RetryPolicy jitter"):
        retry_from_env()
