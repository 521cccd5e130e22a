"""Argument checks: the run name rule (the same as storage's, stated here with examples), and
every integer bounded by its column type, refused with ``InvalidValueError`` naming the
argument, the value and the range before any statement reaches the database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import event

from tests.catalog.conftest import register
from zephon.catalog import Catalog, InvalidValueError, plan_retention, validate

BIGINT = 2**63 - 1
INT = 2**31 - 1

# The rule: 1-128 characters of [A-Za-z0-9._-]; not ".", "..", "_attempts" (storage keeps a
# run's attempt records in <run>/_attempts/) or a step directory name, save-<step> with the
# step written as storage writes it (no sign, no leading zero).
ACCEPTED = [
    "a",
    "Z",
    "0",
    "run-1",
    "llama-7b.lr3e-4",
    "a_b",
    "...",
    ".hidden",
    "trailing.",
    "-",
    "_",
    "save",
    "save-",
    "save-05",
    "save-00",
    "save--5",
    "save-5a",
    "save-5.1",
    "save_5",
    "Save-5",
    "SAVE-5",
    "xsave-5",
    "save-5-",
    "_attempts2",
    "_Attempts",
    "attempts",
    "_COMMIT",
    "a" * 128,
]
REFUSED = [
    "",
    ".",
    "..",
    "_attempts",
    "save-0",
    "save-5",
    "save-1500",
    f"save-{BIGINT}",
    "save-99999999999999999999999",
    "a" * 129,
    "a/b",
    "../x",
    "a b",
    " a",
    "a\n",
    "a\x00",
    "run:1",
    "a\\b",
    "~",
    "*",
    "ü",
    "ﬁ",  # a ligature some normalisations turn into ASCII "fi"
    "٣",  # an Arabic-Indic digit: not [0-9]
    None,
    5,
    b"run",
    ["run"],
]


@pytest.mark.parametrize("name", ACCEPTED)
def test_a_run_name_storage_accepts_is_accepted(name):
    assert validate.run_name(name) == name and validate.is_run_name(name)


@pytest.mark.parametrize("name", REFUSED, ids=repr)
def test_a_run_name_storage_refuses_is_refused(name):
    assert not validate.is_run_name(name)
    with pytest.raises(InvalidValueError) as caught:
        validate.run_name(name)
    assert caught.value.argument == "run name" and caught.value.value == name
    assert caught.value.allowed == validate.RUN_NAME_RULE
    assert "'_attempts'" in str(caught.value) and "'save-5'" in str(caught.value)


def test_a_huge_hostile_name_still_gives_a_short_one_line_error():
    with pytest.raises(InvalidValueError) as caught:
        validate.run_name("x" * 1_000_000 + "\n")
    message = str(caught.value)
    assert len(message) < 400 and "\n" not in message
    assert "(1,000,001 characters)" in message


@pytest.mark.parametrize("name", ["save-5", "_attempts", ".."])
def test_the_catalog_refuses_reserved_run_names_at_registration(catalog, name):
    for call in (catalog.ensure_run, catalog.create_run):
        with pytest.raises(InvalidValueError, match="run name"):
            call(name, f"/c/{name}")
    assert catalog.list_runs() == []


NOW = datetime(2027, 1, 10, tzinfo=UTC)

# (call on a catalog with run "r", argument named, value, range in the message)
OUT_OF_RANGE = [
    (lambda c: c.create_run("n", "/c", total_steps=0), "total_steps", 0, f"from 1 to {BIGINT}"),
    (lambda c: c.ensure_run("r", "/c/r", total_steps=-1), "total_steps", -1, "from 1"),
    (
        lambda c: c.ensure_run("r", "/c/r", num_to_keep=10**30),
        "num_to_keep",
        10**30,
        "to 2147483647",
    ),
    (lambda c: c.update_run("r", num_to_keep=2**31), "num_to_keep", 2**31, f"from 1 to {INT}"),
    (lambda c: c.update_run("r", num_to_keep=0), "num_to_keep", 0, f"from 1 to {INT}"),
    (lambda c: c.update_run("r", num_to_keep=True), "num_to_keep", True, "an integer"),
    (lambda c: c.update_run("r", keep_every_steps=2**63), "keep_every_steps", 2**63, "to 9223"),
    (lambda c: c.begin_checkpoint("r", 2**63, "/p"), "step", 2**63, f"from 0 to {BIGINT}"),
    (lambda c: c.begin_checkpoint("r", -1, "/p"), "step", -1, f"from 0 to {BIGINT}"),
    (lambda c: c.begin_checkpoint("r", 1, "/p", epoch=2**63), "epoch", 2**63, "from 0"),
    (
        lambda c: c.mark_committed("r", 1, "s", bytes=2**63, file_count=1, manifest_checksum=None),
        "bytes",
        2**63,
        f"from 0 to {BIGINT}",
    ),
    (
        lambda c: c.mark_committed("r", 1, "s", bytes=1, file_count=2**31, manifest_checksum=None),
        "file_count",
        2**31,
        f"from 0 to {INT}",
    ),
    (
        lambda c: c.upsert_committed(
            "r", 1, "/p", save_id="s", epoch=0, bytes=1, file_count=-1, manifest_checksum=None
        ),
        "file_count",
        -1,
        "from 0",
    ),
    (lambda c: register(c, "r", 2**63), "epoch", 2**63, f"from 1 to {BIGINT}"),
    (lambda c: register(c, "r", 1, pid=2**31), "pid", 2**31, f"from 0 to {INT}"),
    (lambda c: register(c, "r", 1, resumed_from=2**63), "resumed_from", 2**63, "from 0"),
    (lambda c: c.decide_resume("r", epoch=0, resumed_from=1), "epoch", 0, "from 1"),
    (lambda c: c.get_checkpoint("r", 2**63), "step", 2**63, "from 0"),
    (lambda c: c.rows_after("r", 2**63, states="pending"), "step", 2**63, "from 0"),
    (lambda c: c.claim_for_deletion("r", [1, 2**63]), "step", 2**63, "from 0"),
    (lambda c: c.record_event("x", step=2**63), "step", 2**63, "from 0"),
    (lambda c: c.events(limit=0), "limit", 0, f"from 1 to {BIGINT}"),
    (lambda c: c.events(limit=2**63), "limit", 2**63, f"from 1 to {BIGINT}"),
    (lambda c: c.retention_plan("r", grace=timedelta.max), "grace", timedelta.max, "days"),
    (
        lambda c: c.claim_for_deletion("r", [1], lease=timedelta(0)),
        "lease",
        timedelta(0),
        "above 0",
    ),
    (lambda c: c.expired_claims(lease=-timedelta(1)), "lease", -timedelta(1), "above 0"),
    (lambda c: c.prune_events(older_than=timedelta(-1)), "older_than", timedelta(-1), "from 0"),
    (lambda c: c.prune_events(older_than=timedelta(1), batch_size=0), "batch_size", 0, "from 1"),
    (
        lambda c: c.prune_events(older_than=timedelta(1), now=datetime(2027, 1, 1)),
        "now",
        datetime(2027, 1, 1),
        "timezone-aware",
    ),
]

NOT_STORABLE = [
    (lambda c: c.ensure_run("r", "/c/\x00r"), "storage_url", "/c/\x00r", "NUL"),
    (lambda c: c.begin_checkpoint("r", 1, "/p\x00"), "path", "/p\x00", "NUL"),
    (lambda c: c.update_run("r", config={"lr": float("nan")}), "config", None, "JSON"),
    (lambda c: c.update_run("r", config={"f": object()}), "config", None, "JSON"),
    (lambda c: c.update_run("r", config={"s": "a\x00b"}), "config", None, "NUL"),
    (lambda c: c.record_event("x", detail={"v": float("inf")}), "detail", None, "JSON"),
    (lambda c: c.record_event("x" * 33), "event action", "x" * 33, "1-32"),
    (lambda c: c.record_event("x", run="save-5"), "run name", "save-5", "save-5"),
    (lambda c: c.mark_failed("r", 1, "not a token", "why"), "save_id", "not a token", "1-64"),
    (lambda c: c.mark_deleted("r", 1, "t" * 256), "claim_token", "t" * 256, "1-255"),
    (
        lambda c: c.mark_committed("r", 1, "s", bytes=1, file_count=1, manifest_checksum="c" * 129),
        "manifest_checksum",
        "c" * 129,
        "1-128",
    ),
]


@pytest.mark.parametrize(
    ("call", "argument", "value", "allowed"),
    OUT_OF_RANGE + NOT_STORABLE,
    ids=[f"{case[1]}={str(case[2])[:20]}" for case in OUT_OF_RANGE + NOT_STORABLE],
)
def test_a_value_its_column_cannot_hold_is_refused_before_any_database_work(
    catalog, run, call, argument, value, allowed
):
    statements: list[str] = []

    def _count(_conn, _cursor, statement, *_args) -> None:
        statements.append(statement)

    event.listen(catalog._db.engine, "before_cursor_execute", _count)
    try:
        with pytest.raises(InvalidValueError) as caught:
            call(catalog)
    finally:
        event.remove(catalog._db.engine, "before_cursor_execute", _count)
    assert statements == []
    error = caught.value
    assert error.argument == argument
    if value is not None:
        assert error.value == value
    assert allowed in error.allowed
    assert str(error).startswith(f"invalid {argument} ")


def test_the_largest_value_of_each_column_is_stored_and_read_back(catalog):
    record = catalog.ensure_run(
        "r", "/c/r", total_steps=BIGINT, num_to_keep=INT, keep_every_steps=BIGINT
    )
    assert (record.total_steps, record.num_to_keep, record.keep_every_steps) == (
        BIGINT,
        INT,
        BIGINT,
    )
    register(catalog, "r", BIGINT, pid=INT, resumed_from=BIGINT - 1)
    begun = catalog.begin_checkpoint("r", BIGINT, "/c/r/save-max", epoch=BIGINT)
    catalog.mark_committed(
        "r",
        BIGINT,
        begun.save_id,
        epoch=BIGINT,
        bytes=BIGINT,
        file_count=INT,
        manifest_checksum="c" * 128,
    )
    latest = catalog.latest_committed("r")
    assert (latest.step, latest.epoch, latest.bytes, latest.file_count) == (
        BIGINT,
        BIGINT,
        BIGINT,
        INT,
    )
    assert catalog.current_attempt("r").pid == INT
    assert catalog.events(limit=BIGINT)[0].action == "committed"


def test_a_failure_reason_with_nul_characters_is_kept_readable_rather_than_refused(catalog, run):
    # Reasons come from exception messages; failing the failure path would lose the save's end.
    begun = catalog.begin_checkpoint(run, 1, "/c/r/save-1")
    failed = catalog.mark_failed(run, 1, begun.save_id, "disk \x00 full")
    assert failed.failure_reason == "disk \\x00 full"
    begun = catalog.begin_checkpoint(run, 1, "/c/r/save-1")
    assert catalog.mark_failed(run, 1, begun.save_id, "").failure_reason == ""


def test_the_pure_planner_refuses_the_same_policy_values():
    with pytest.raises(InvalidValueError, match="num_to_keep"):
        plan_retention([], 10**30, None, NOW, timedelta(0))
    with pytest.raises(InvalidValueError, match="keep_every_steps"):
        plan_retention([], None, 2**63, NOW, timedelta(0))


def test_an_actor_that_does_not_fit_the_claim_token_is_refused(tmp_path):
    with pytest.raises(InvalidValueError, match="actor"):
        Catalog(f"sqlite:///{tmp_path}/c.db", actor="a" * 243)
    assert not (tmp_path / "c.db").exists()
