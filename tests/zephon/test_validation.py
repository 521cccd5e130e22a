"""One rule per value, wherever it is checked: storage and the catalog accept exactly the same
run names, the job config refuses what a catalog column cannot hold, and a manager refuses a
bad run name before anything is registered."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog import Catalog, InvalidValueError
from catalog import validate as catalog_validate
from storage import InvalidNameError, validate_run
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig
from zephon.errors import ConfigError

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
