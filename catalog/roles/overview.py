"""``Catalog``'s batch reads for dashboards (``zephon ui``): a page of runs with their
aggregates, and the save rows and attempts of several runs at once.

Each method is one read transaction whose cost is bounded by the runs asked for, never by the
whole catalog: a dashboard over 1,000 runs of 1,000 checkpoints reads one page of runs, and
the goodput inputs of that page only (two queries, not one per run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Select, String, and_, func, select, text, type_coerce
from sqlalchemy.orm import Session, aliased

from zephon.catalog import validate
from zephon.catalog.models import Attempt, Checkpoint, CheckpointState, Replica, Run
from zephon.catalog.records import AttemptRecord, RunRecord, RunSummary
from zephon.catalog.session_base import CatalogBase

__all__ = ["AttemptSaves", "CopyRow", "OverviewMethods", "RunPage", "SaveRow", "TimelineRow"]

#: most runs one page may hold (and runs one batch read may name)
MAX_PAGE = 500


@dataclass(frozen=True, slots=True)
class RunPage:
    """One page of runs by name: ``total`` runs match (all pages), ``runs`` are this page's
    summaries (``offset`` to ``offset + limit``)."""

    total: int
    offset: int
    limit: int
    runs: list[RunSummary]


@dataclass(frozen=True, slots=True)
class SaveRow:
    """The goodput inputs of one checkpoint row: its ``step``, the attempt that armed it
    (``epoch``), when it began and committed, and its ``stall_s`` (0 when not timed)."""

    step: int
    epoch: int
    created_at: datetime
    committed_at: datetime | None
    stall_s: float


@dataclass(frozen=True, slots=True)
class AttemptSaves:
    """The checkpoint rows one attempt (``epoch``) of a run armed, in aggregate: how many
    (``saves``), when the first and the last began, when the last committed, and their
    ``stall_s`` in all. ``kept_until`` is when the newest of them that every later decided
    attempt resumed from or above began (None: none, or no later attempt decided), and
    ``stall_after_kept_s`` the stall of those that began from then on: what a restart lost
    of this attempt's work (``zephon.goodput`` defines both)."""

    epoch: int
    saves: int
    first_created_at: datetime
    last_created_at: datetime
    last_committed_at: datetime | None
    stall_s: float
    kept_until: datetime | None
    stall_after_kept_s: float


@dataclass(frozen=True, slots=True)
class TimelineRow:
    """What a timeline shows of one checkpoint row: ``trigger`` is its metadata's
    ``trigger`` (``"emergency"`` for an emergency save; None: a periodic one), ``timings``
    its phases (empty: not timed)."""

    step: int
    state: str
    epoch: int
    pinned: bool
    bytes: int | None
    trigger: str | None
    created_at: datetime
    committed_at: datetime | None
    timings: dict[str, float]
    failure_reason: str | None


@dataclass(frozen=True, slots=True)
class CopyRow:
    """One replica of a checkpoint as a timeline shows it: where (``tier``, ``host``), its
    ``state`` and when it committed."""

    step: int
    tier: str
    host: str
    state: str
    committed_at: datetime | None


def _when(column, dialect: str):
    """A timestamp column as the driver gives it, without the ORM type's conversion: on
    SQLite the stored text (fixed-width ISO 8601 in UTC, so it also orders and compares as
    time does), which ``_time`` parses at C speed; SQLAlchemy's own parsing of 100,000 of
    them costs more than the query."""
    return type_coerce(column, String) if dialect == "sqlite" else column


def _time(value: str | datetime | None) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        return datetime.fromisoformat(value).replace(tzinfo=UTC)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _run_ids(session: Session, names: list[str]) -> dict[int, str]:
    """The ids of the runs named ``names`` that exist, to their names. The batch reads then
    filter by id: PostgreSQL plans a filter by a list of ids from the index's statistics,
    where behind a join on names it scanned and hashed the whole table."""
    return dict(session.execute(select(Run.id, Run.name).where(Run.name.in_(names))).all())


def _without_jit(session: Session) -> None:
    """PostgreSQL: no JIT compilation for the rest of this transaction. The planner guesses
    3,000 attempts for any page and prices the per-attempt subquery at each, so it put the
    aggregate of 50 runs above ``jit_above_cost`` (and 500 runs above the inlining and
    optimising thresholds): compiling then took 0.2-2 s for a query that runs in 15-60 ms.
    Reads bounded by ``MAX_PAGE`` runs never win that back."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL jit = off"))


def _attempt_saves(ids: list[int], dialect: str) -> Select:
    """The per-attempt aggregate of ``save_summaries`` over the runs ``ids``: one row per
    (run_id, epoch) with ``saves``, ``first``, ``last``, ``committed``, ``stall``,
    ``kept_until`` and ``after`` (``AttemptSaves`` defines each).

    One pass over the runs' entries of ``ix_checkpoints_attempt_saves`` aggregates them per
    attempt; then, per attempt, two short reads of its own range of the index: its newest
    committed row at or below the floor (read backwards from the newest, so it stops at
    the kept save) and the stall from that save on. Joining the floors to every row instead
    cost SQLite a lookup per row, as much as the aggregate itself."""
    created = _when(Checkpoint.created_at, dialect)
    per_attempt = (
        select(
            Checkpoint.run_id,
            Checkpoint.epoch,
            func.count().label("saves"),
            func.min(created).label("first"),
            func.max(created).label("last"),
            func.max(_when(Checkpoint.committed_at, dialect)).label("committed"),
            func.sum(func.coalesce(Checkpoint.stall_s, 0.0)).label("stall"),
        )
        .where(Checkpoint.run_id.in_(ids))
        .group_by(Checkpoint.run_id, Checkpoint.epoch)
        .subquery("per_attempt")
    )
    later = aliased(Attempt)
    # the lowest step a later decided attempt resumed from (-1: a fresh start), per
    # attempt of the runs: only rows at or below it were kept
    floors = (
        select(
            Attempt.run_id,
            Attempt.epoch,
            func.min(func.coalesce(later.resumed_from, -1)).label("floor"),
        )
        .join(
            later,
            and_(
                later.run_id == Attempt.run_id,
                later.epoch > Attempt.epoch,
                later.decided_at.is_not(None),
            ),
        )
        .where(Attempt.run_id.in_(ids))
        .group_by(Attempt.run_id, Attempt.epoch)
        .subquery("floors")
    )
    kept_rows = aliased(Checkpoint)
    kept_until = (
        select(_when(kept_rows.created_at, dialect))
        .where(
            kept_rows.run_id == per_attempt.c.run_id,
            kept_rows.epoch == per_attempt.c.epoch,
            kept_rows.committed_at.is_not(None),
            kept_rows.step <= floors.c.floor,
        )
        .order_by(kept_rows.created_at.desc())
        .limit(1)
        .scalar_subquery()
    )
    kept = (
        select(per_attempt, kept_until.label("kept_until"))
        .outerjoin(
            floors,
            and_(floors.c.run_id == per_attempt.c.run_id, floors.c.epoch == per_attempt.c.epoch),
        )
        .subquery("kept")
    )
    # NULL without a kept save (no later decided attempt, or none of its rows at or below
    # the floor): no row compares >= NULL
    after_rows = aliased(Checkpoint)
    after = (
        select(func.sum(func.coalesce(after_rows.stall_s, 0.0)))
        .where(
            after_rows.run_id == kept.c.run_id,
            after_rows.epoch == kept.c.epoch,
            _when(after_rows.created_at, dialect) >= kept.c.kept_until,
        )
        .scalar_subquery()
    )
    return select(kept, after.label("after")).order_by(kept.c.run_id, kept.c.epoch)


class OverviewMethods(CatalogBase):
    """The batch reads of a dashboard; every one reads, none writes."""

    def run_page(self, *, offset: int = 0, limit: int = 50, status: str | None = None) -> RunPage:
        """Runs ``offset`` to ``offset + limit`` by name (only those in ``status``, if given),
        with the aggregates of ``list_runs``, and how many runs match in all.

        Each aggregate reads only the index entries and rows it needs (the committed rows,
        the pending entries, the live rows), never a run's whole history: on a run of
        1,000 saves that retention mostly deleted, that is a few rows, not 1,000. So
        ``last_activity`` is the newest change of the run or of its rows that are not
        ``deleted`` (``list_runs`` also counts the time a row was deleted)."""
        offset = validate.integer("offset", offset, minimum=0)
        limit = validate.integer("limit", limit, minimum=1, maximum=MAX_PAGE)
        if status is not None:
            status = validate.status(status)
        page = select(Run).order_by(Run.name).offset(offset).limit(limit)
        count = select(func.count()).select_from(Run)
        if status is not None:
            page = page.where(Run.status == status)
            count = count.where(Run.status == status)
        with self._transaction("list a page of runs", write=False) as transaction:
            session = transaction.session
            total = session.execute(count).scalar_one()
            runs = list(session.scalars(page))
            ids = [run.id for run in runs]
            aggregates = (
                select(
                    Checkpoint.run_id,
                    func.count().label("count"),
                    func.sum(Checkpoint.bytes).label("bytes"),
                    func.max(Checkpoint.step).label("latest"),
                )
                .where(
                    Checkpoint.run_id.in_(ids),
                    Checkpoint.state == CheckpointState.COMMITTED,
                )
                .group_by(Checkpoint.run_id)
                .subquery()
            )
            # the latest committed row's timings: one lookup on the unique (run_id, step) each
            newest = aliased(Checkpoint)
            committed = {
                row.run_id: row
                for row in session.execute(
                    select(aggregates, newest.timings).join(
                        newest,
                        and_(
                            newest.run_id == aggregates.c.run_id,
                            newest.step == aggregates.c.latest,
                        ),
                    )
                )
            }
            pending = dict(
                session.execute(
                    select(Checkpoint.run_id, func.count())
                    .where(Checkpoint.run_id.in_(ids), Checkpoint.state == CheckpointState.PENDING)
                    .group_by(Checkpoint.run_id)
                ).all()
            )
            live = [state for state in CheckpointState if state != CheckpointState.DELETED]
            touched = dict(
                session.execute(
                    select(Checkpoint.run_id, func.max(Checkpoint.updated_at))
                    .where(Checkpoint.run_id.in_(ids), Checkpoint.state.in_(live))
                    .group_by(Checkpoint.run_id)
                ).all()
            )
            summaries = []
            for run in runs:
                kept = committed.get(run.id)
                summaries.append(
                    RunSummary(
                        run=RunRecord.of(run),
                        committed_count=kept.count if kept else 0,
                        # PostgreSQL's sum(bigint) is numeric (Decimal in Python)
                        committed_bytes=int(kept.bytes or 0) if kept else 0,
                        latest_step=kept.latest if kept else None,
                        pending_count=pending.get(run.id, 0),
                        last_activity=max(filter(None, (run.updated_at, touched.get(run.id)))),
                        latest_timings=kept.timings if kept else None,
                    )
                )
        return RunPage(total=total, offset=offset, limit=limit, runs=summaries)

    def save_rows(self, runs: Sequence[str]) -> dict[str, list[SaveRow]]:
        """Every checkpoint row of each of ``runs`` (at most ``MAX_PAGE`` names), as
        ``SaveRow``s in step order, in one query; a run the catalog does not know maps to
        an empty list."""
        names = self._names(runs)
        dialect = self.dialect
        found: dict[str, list[SaveRow]] = {name: [] for name in names}
        with self._transaction("read the saves of runs", write=False) as transaction:
            session = transaction.session
            ids = _run_ids(session, names)
            if not ids:
                return found
            _without_jit(session)
            # index-only on ix_checkpoints_attempt_saves: no row's JSON is read
            statement = (
                select(
                    Checkpoint.run_id,
                    Checkpoint.step,
                    Checkpoint.epoch,
                    _when(Checkpoint.created_at, dialect),
                    _when(Checkpoint.committed_at, dialect),
                    Checkpoint.stall_s,
                )
                .where(Checkpoint.run_id.in_(ids))
                .order_by(Checkpoint.run_id, Checkpoint.step)
            )
            for run_id, step, epoch, created, committed, stall in session.execute(statement):
                created_at = _time(created)
                assert created_at is not None  # created_at is NOT NULL
                stall_s = max(0.0, stall) if stall is not None else 0.0
                found[ids[run_id]].append(
                    SaveRow(step, epoch, created_at, _time(committed), stall_s)
                )
        return found

    def save_summaries(self, runs: Sequence[str]) -> dict[str, list[AttemptSaves]]:
        """Per run of ``runs`` (at most ``MAX_PAGE`` names), its checkpoint rows aggregated
        per attempt that armed them, ascending epoch: what goodput needs of a run's saves,
        computed by the database, so that a page of runs does not move every row into
        Python.

        One query, index-only on ``ix_checkpoints_attempt_saves`` (the stall is a column:
        no row's JSON is read): the runs' entries aggregated per attempt, then two short
        reads of each attempt's own range (``_attempt_saves``)."""
        names = self._names(runs)
        dialect = self.dialect
        found: dict[str, list[AttemptSaves]] = {name: [] for name in names}
        with self._transaction("summarise the saves of runs", write=False) as transaction:
            session = transaction.session
            ids = _run_ids(session, names)
            if not ids:
                return found
            _without_jit(session)
            for row in session.execute(_attempt_saves(list(ids), dialect)):
                first, last = _time(row.first), _time(row.last)
                assert first is not None and last is not None  # a group has rows
                found[ids[row.run_id]].append(
                    AttemptSaves(
                        epoch=row.epoch,
                        saves=row.saves,
                        first_created_at=first,
                        last_created_at=last,
                        last_committed_at=_time(row.committed),
                        stall_s=max(0.0, float(row.stall or 0.0)),
                        kept_until=_time(row.kept_until),
                        stall_after_kept_s=max(0.0, float(row.after or 0.0)),
                    )
                )
        return found

    def timeline(
        self,
        run: str,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        states: Sequence[str] | None = None,
    ) -> tuple[list[TimelineRow], list[CopyRow]]:
        """A run's checkpoint rows begun in ``[since, until]`` (either open) and in
        ``states`` (None: all), ascending step, and the replicas of those steps: two
        queries of only the columns a timeline draws (``RunNotFoundError`` without the
        run). Lighter than ``list_checkpoints`` plus ``replicas``, which build full records."""
        run = validate.run_name(run)
        wanted = validate.states(states)
        if since is not None:
            since = validate.aware("since", since)
        if until is not None:
            until = validate.aware("until", until)
        dialect = self.dialect
        conditions = []
        if since is not None:
            conditions.append(Checkpoint.created_at >= since)
        if until is not None:
            conditions.append(Checkpoint.created_at <= until)
        if wanted is not None:
            conditions.append(Checkpoint.state.in_(wanted))
        action = f"read the timeline of run {run!r}"
        with self._run_transaction(action, run, write=False) as transaction:
            run_id = transaction.run.id
            rows = transaction.session.execute(
                select(
                    Checkpoint.step,
                    Checkpoint.state,
                    Checkpoint.epoch,
                    Checkpoint.pinned,
                    Checkpoint.bytes,
                    Checkpoint.meta,
                    _when(Checkpoint.created_at, dialect),
                    _when(Checkpoint.committed_at, dialect),
                    Checkpoint.timings,
                    Checkpoint.failure_reason,
                )
                .where(Checkpoint.run_id == run_id, *conditions)
                .order_by(Checkpoint.step)
            ).all()
            steps = [row[0] for row in rows]
            copies = []
            if steps:
                low, high = min(steps), max(steps)
                copies = transaction.session.execute(
                    select(
                        Replica.step,
                        Replica.tier,
                        Replica.host,
                        Replica.state,
                        _when(Replica.committed_at, dialect),
                    )
                    .where(Replica.run_id == run_id, Replica.step.between(low, high))
                    .order_by(Replica.step, Replica.tier, Replica.host)
                ).all()
        timeline = []
        for step, state, epoch, pinned, size, meta, created, committed, timings, reason in rows:
            created_at = _time(created)
            assert created_at is not None  # created_at is NOT NULL
            trigger = meta.get("trigger") if isinstance(meta, dict) else None
            timeline.append(
                TimelineRow(
                    step=step,
                    state=str(state),
                    epoch=epoch,
                    pinned=bool(pinned),
                    bytes=size,
                    trigger=trigger if isinstance(trigger, str) else None,
                    created_at=created_at,
                    committed_at=_time(committed),
                    timings=dict(timings) if isinstance(timings, dict) else {},
                    failure_reason=reason,
                )
            )
        shown = set(steps)
        replicas = [
            CopyRow(step, str(tier), host, str(state), _time(committed))
            for step, tier, host, state, committed in copies
            if step in shown
        ]
        return timeline, replicas

    def attempts_of(self, runs: Sequence[str]) -> dict[str, list[AttemptRecord]]:
        """The registered attempts of each of ``runs`` (at most ``MAX_PAGE`` names), ascending
        epoch, in one query; a run without any (or unknown) maps to an empty list."""
        names = self._names(runs)
        statement = (
            select(Run.name, Attempt)
            .join(Run, Run.id == Attempt.run_id)
            .where(Run.name.in_(names))
            .order_by(Attempt.run_id, Attempt.epoch)
        )
        found: dict[str, list[AttemptRecord]] = {name: [] for name in names}
        with self._transaction("read the attempts of runs", write=False) as transaction:
            for name, row in transaction.session.execute(statement):
                found[name].append(AttemptRecord.of(row, name))
        return found

    @staticmethod
    def _names(runs: Sequence[str]) -> list[str]:
        if isinstance(runs, str):
            raise TypeError("runs must be a sequence of run names, not one name")
        names = list(dict.fromkeys(validate.run_name(name) for name in runs))
        if len(names) > MAX_PAGE:
            validate.integer("number of runs", len(names), minimum=0, maximum=MAX_PAGE)
        return names
