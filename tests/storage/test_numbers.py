"""Steps, epochs and ranks read from names and arguments are ASCII digits only: ``int()``,
``str.isdigit()`` and the regex ``\\d`` also take other scripts' digits ("٤" is 4), which
would make ``save-٤`` or ``zephon://r/٤`` name step 4."""

from __future__ import annotations

import pytest

from zephon.storage import CheckpointStore, parse_number, parse_step_dirname


@pytest.mark.parametrize(
    ("text", "number"),
    [("4", 4), ("04", 4), ("9223372036854775807", 2**63 - 1), ("٤", None), ("¹", None),
     ("-1", None), ("+4", None), (" 4", None), ("4\n", None), ("4_0", None), ("", None),
     ("9223372036854775808", None), ("9" * 5000, None), (4, None)],
)  # fmt: skip
def test_a_number_is_ascii_digits_up_to_the_largest_step(text, number):
    assert parse_number(text) == number


def test_a_step_directory_name_takes_ascii_digits_only():
    assert parse_step_dirname("save-4") == 4
    for name in ("save-٤", "save-04", "save-4\n", "save-", "save-9223372036854775808"):
        assert parse_step_dirname(name) is None


def test_an_attempt_record_named_in_other_digits_is_no_epoch(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    fence = store.run("r").claim_attempt(after=store.run("r").lineage())
    records = tmp_path / "ckpt" / "r" / "_attempts"
    good = (records / "0000000001.json").read_bytes()
    (records / "٠٠٠٠٠٠٠٠٠٩.json").write_bytes(good.replace(b'"epoch":1', b'"epoch":9'))
    assert store.run("r").lineage().epoch == fence.epoch == 1
    assert [record.epoch for record in store.run("r").attempts()] == [1]
