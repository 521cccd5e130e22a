"""Retention planning (pure): table-driven cases and a property test over random runs."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.catalog import Action, InvalidValueError, ResumePoint, plan_retention

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
GRACE = timedelta(hours=24)


@dataclass(frozen=True)
class Row:
    step: int
    state: str = "committed"
    pinned: bool = False
    created_at: datetime = NOW - timedelta(days=3)
    save_id: str = "a"
    updated_at: datetime = NOW - timedelta(days=3)


def _committed(*steps: int) -> list[Row]:
    return [Row(s) for s in steps]


@pytest.mark.parametrize(
    ("rows", "num_to_keep", "keep_every", "deleted"),
    [
        pytest.param(_committed(1, 2, 3, 4, 5), 2, None, [1, 2, 3], id="keep-2-newest"),
        pytest.param(_committed(1, 2, 3), None, None, [], id="null-keeps-all"),
        pytest.param(_committed(1, 2, 3), 1, None, [1, 2], id="keep-1"),
        pytest.param(_committed(1, 2, 3), 10, None, [], id="fewer-than-n"),
        pytest.param(_committed(100, 200, 300, 400, 500), 1, 200, [100, 300], id="milestones-kept"),
        pytest.param([Row(1, pinned=True), Row(2), Row(3)], 1, None, [2], id="pinned-kept"),
        pytest.param([Row(0)], 1, 1000, [], id="only-one"),
        pytest.param(_committed(30, 10, 20), 1, None, [10, 20], id="unordered-input"),
        pytest.param(
            [Row(1), Row(2), Row(3, "pending"), Row(4, "pending")],
            1,
            None,
            [1],
            id="pending-not-counted",
        ),
        pytest.param(
            [Row(1, "deleting"), Row(2, "deleted"), Row(3, "failed"), Row(4), Row(5)],
            1,
            None,
            [4],
            id="other-states-ignored",
        ),
        pytest.param([], 1, None, [], id="empty"),
    ],
)
def test_plan_deletes_exactly_the_unprotected_older_committed_rows(
    rows, num_to_keep, keep_every, deleted
):
    plan = plan_retention(rows, num_to_keep, keep_every, NOW, GRACE)
    assert plan.to_delete == deleted


def test_every_decision_explains_itself():
    rows = [Row(100, pinned=True), Row(150), Row(200), Row(250), Row(300)]
    plan = plan_retention(rows, 2, 100, NOW, GRACE)
    reasons = {d.step: d.reason for d in plan.decisions}
    assert reasons == {
        100: "milestone (every 100 steps); pinned",
        150: "older than the 2 newest committed",
        200: "milestone (every 100 steps)",
        250: "one of the 2 newest committed",
        300: "newest committed; one of the 2 newest committed; milestone (every 100 steps)",
    }
    assert [d.step for d in plan.decisions] == [100, 150, 200, 250, 300]


def test_young_pending_rows_are_kept_and_old_ones_expire_with_their_save():
    rows = [
        Row(1),
        Row(2, "pending", created_at=NOW - timedelta(hours=1), save_id="young"),
        Row(3, "pending", created_at=NOW - timedelta(hours=30), save_id="stale"),
        Row(4, "pending", created_at=NOW - GRACE, save_id="exactly-grace"),
    ]
    plan = plan_retention(rows, 1, None, NOW, GRACE)
    assert [(d.step, d.save_id) for d in plan.to_expire] == [(3, "stale"), (4, "exactly-grace")]
    young = next(d for d in plan.decisions if d.step == 2)
    assert young.action is Action.KEEP and "within grace 24h" in young.reason
    assert "probe its commit marker" in plan.to_expire[0].reason
    assert plan.to_delete == []


def test_pending_rows_expire_after_pending_grace_whatever_grace_says():
    rows = [
        Row(1, "pending", created_at=NOW - timedelta(hours=1)),
        Row(2, "pending", created_at=NOW - timedelta(hours=3)),
    ]
    plan = plan_retention(rows, 1, None, NOW, timedelta(0))  # gc --grace 0
    assert plan.to_expire == [] and {d.action for d in plan.decisions} == {Action.KEEP}
    plan = plan_retention(rows, 1, None, NOW, timedelta(0), pending_grace=timedelta(hours=2))
    assert [d.step for d in plan.to_expire] == [2]


def test_stale_rows_are_deleted_only_once_stale_for_longer_than_grace():
    rows = [
        Row(1),
        Row(2, "stale", updated_at=NOW - timedelta(hours=1)),
        Row(3, "stale", updated_at=NOW - timedelta(hours=30)),
        Row(4, "stale", updated_at=NOW - timedelta(hours=30), pinned=True),
    ]
    plan = plan_retention(rows, 1, None, NOW, GRACE)
    assert plan.to_delete == [3]
    reasons = {d.step: d.reason for d in plan.decisions}
    assert reasons[2] == "abandoned lineage, stale for 1h, within grace 24h"
    assert reasons[3] == "abandoned lineage, stale for 30h, beyond grace 24h"
    assert reasons[4] == "abandoned lineage, stale for 30h; pinned"
    assert plan_retention(rows, 1, None, NOW, timedelta(0)).to_delete == [2, 3]


def test_corrupt_rows_are_kept_until_deletion_is_asked_for_and_never_counted():
    rows = [Row(1), Row(2), Row(3, "corrupt"), Row(4, "corrupt", pinned=True)]
    plan = plan_retention(rows, 2, None, NOW, GRACE)
    assert plan.to_delete == []  # 1 and 2 are the 2 newest committed: 3 and 4 do not count
    assert "kept for inspection" in next(d for d in plan.decisions if d.step == 3).reason
    assert plan_retention(rows, 2, None, NOW, GRACE, corrupt=True).to_delete == [3]


def test_the_current_attempts_resume_point_is_always_kept():
    rows = [Row(1), Row(2), Row(3), Row(4, "corrupt"), Row(5, "stale"), Row(6)]
    for step in (2, 4, 5):
        plan = plan_retention(
            rows, 1, None, NOW, timedelta(0), corrupt=True, resume_point=ResumePoint(step, 7)
        )
        assert step not in plan.to_delete
        kept = next(d for d in plan.decisions if d.step == step)
        assert kept.action is Action.KEEP
        assert "resume point of the current attempt (epoch 7)" in kept.reason
    plan = plan_retention(rows, 1, None, NOW, timedelta(0), resume_point=ResumePoint(2, 7))
    assert plan.to_delete == [1, 3, 5]


@pytest.mark.parametrize(
    ("num_to_keep", "keep_every", "grace", "now"),
    [
        (0, None, GRACE, NOW),
        (None, 0, GRACE, NOW),
        (1.5, None, GRACE, NOW),
        (1, None, timedelta(seconds=-1), NOW),
        (1, None, GRACE, NOW.replace(tzinfo=None)),
    ],
)
def test_invalid_policies_are_refused(num_to_keep, keep_every, grace, now):
    with pytest.raises(InvalidValueError):
        plan_retention([], num_to_keep, keep_every, now, grace)


states = st.sampled_from(
    ["pending", "committed", "committed", "deleting", "deleted", "failed", "stale", "corrupt"]
)
ages = st.integers(0, 72 * 3600).map(lambda s: NOW - timedelta(seconds=s))
rows_strategy = st.lists(
    st.builds(
        Row,
        step=st.integers(0, 500),
        state=states,
        pinned=st.booleans(),
        created_at=ages,
        updated_at=ages,
    ),
    max_size=40,
    unique_by=lambda r: r.step,
)


@settings(max_examples=400, deadline=None)
@given(
    rows=rows_strategy,
    num_to_keep=st.none() | st.integers(1, 10),
    keep_every=st.none() | st.integers(1, 200),
    grace_hours=st.integers(0, 48),
    pending_grace_hours=st.integers(0, 48),
    corrupt=st.booleans(),
    resume=st.none() | st.integers(0, 500),
)
def test_plans_never_delete_what_must_be_kept(
    rows, num_to_keep, keep_every, grace_hours, pending_grace_hours, corrupt, resume
):
    grace = timedelta(hours=grace_hours)
    pending_grace = timedelta(hours=pending_grace_hours)
    resume_point = None if resume is None else ResumePoint(resume, 3)
    plan = plan_retention(
        rows,
        num_to_keep,
        keep_every,
        NOW,
        grace,
        pending_grace=pending_grace,
        corrupt=corrupt,
        resume_point=resume_point,
    )
    by_step = {r.step: r for r in rows}
    deleted = set(plan.to_delete)
    assert resume not in deleted  # the current attempt's resume point, whatever its state
    by_state = {s: {r.step for r in rows if r.state == s} for s in ("stale", "corrupt")}
    # Stale rows go once stale for longer than grace, corrupt ones only when asked.
    assert deleted & by_state["stale"] == {
        s
        for s in by_state["stale"]
        if NOW - by_step[s].updated_at >= grace and not by_step[s].pinned and s != resume
    }
    assert deleted & by_state["corrupt"] == (
        {s for s in by_state["corrupt"] if not by_step[s].pinned and s != resume}
        if corrupt
        else set()
    )
    deleted -= by_state["stale"] | by_state["corrupt"]
    committed = sorted((r.step for r in rows if r.state == "committed"), reverse=True)

    if committed:
        assert committed[0] not in deleted  # the newest committed, whatever the policy
    if num_to_keep is None:
        assert not deleted
    else:
        assert not deleted & set(committed[:num_to_keep])
    for step in deleted:
        row = by_step[step]
        assert row.state == "committed" and not row.pinned
        assert keep_every is None or step % keep_every != 0
    # Exactly the unprotected committed rows go: retention keeps nothing it need not keep.
    # Only committed rows count towards num_to_keep.
    expected = {
        s
        for s in committed[num_to_keep or len(committed) :]
        if not by_step[s].pinned and (keep_every is None or s % keep_every) and s != resume
    }
    assert deleted == expected
    for decision in plan.decisions:
        row = by_step[decision.step]
        if row.state == "pending":
            young = NOW - row.created_at < pending_grace
            assert decision.action is (Action.KEEP if young else Action.EXPIRE)
        else:
            assert decision.action is not Action.EXPIRE
    assert {d.step for d in plan.decisions} == {
        r.step for r in rows if r.state in ("committed", "pending", "stale", "corrupt")
    }
