"""Read-only statements shared by ``Catalog`` and by tests that inspect their query plans."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Select, select

from zephon.catalog.models import Checkpoint, CheckpointState, Run


def latest_committed(run: str) -> Select[tuple[Checkpoint]]:
    """Newest committed checkpoint of the run named ``run``.

    The run id comes from a scalar subquery on the unique name rather than a join, so the
    planner knows it is one value and reads the index ``(run_id, state, step)`` backwards,
    stopping at the first entry: no sort, no visit of the run's other rows (a join made
    PostgreSQL fetch and sort all of the run's committed rows). Checked with EXPLAIN on both
    backends in tests/catalog/test_schema.py.
    """
    run_id = select(Run.id).where(Run.name == run).scalar_subquery()
    return (
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id, Checkpoint.state == CheckpointState.COMMITTED)
        .order_by(Checkpoint.step.desc())
        .limit(1)
    )


def rows_after(run_id: int, step: int | None, states: Sequence[str]) -> Select[tuple[Checkpoint]]:
    """Rows in ``states`` above ``step`` (all steps if None), newest first."""
    statement = (
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id, Checkpoint.state.in_(states))
        .order_by(Checkpoint.step.desc())
    )
    if step is not None:
        statement = statement.where(Checkpoint.step > step)
    return statement


def checkpoints_of(run_id: int, states: Sequence[str] | None) -> Select[tuple[Checkpoint]]:
    """A run's rows in ascending step order, optionally only in ``states``."""
    statement = select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)
    if states is not None:
        statement = statement.where(Checkpoint.state.in_(states))
    return statement


def retention_view(run_id: int, states: Sequence[str]) -> Select:
    """The columns retention planning reads, for a run's rows in ``states``."""
    return select(
        Checkpoint.step,
        Checkpoint.state,
        Checkpoint.pinned,
        Checkpoint.created_at,
        Checkpoint.updated_at,
        Checkpoint.save_id,
    ).where(Checkpoint.run_id == run_id, Checkpoint.state.in_(states))
