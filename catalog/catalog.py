"""``Catalog``: the one object callers use. Validates arguments, runs each call in its own
transaction, records an audit event for every change, and returns frozen records.

Concurrency: every method is one short transaction, so one ``Catalog`` may be shared by the
threads of a process, and any number of processes (jobs, ``zephon gc``, ``zephon sync``) may
use the same database at once; the guarantees are those of the guarded transitions
(``catalog.transitions``) and of the claim protocol (``catalog.claims``). A ``Catalog`` must
not cross a ``fork()``: each process opens its own.

Fencing: a job registers each of its starts with ``register_attempt`` and passes that
attempt's ``epoch`` to the fenced calls (``begin_checkpoint``, ``mark_committed``, and
``update_run``/``claim_for_deletion`` when given an epoch), which are refused with
``FencedOutError`` unless it is the run's current epoch, checked in the transaction that
makes the change (``catalog.attempts``).

Errors: argument problems raise ``InvalidValueError`` before any database work; database
problems raise ``CatalogUnavailableError``/``CatalogDatabaseError``; everything else is one of
the specific ``CatalogError`` subclasses documented per method. Messages mask the password.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Self

from sqlalchemy import select
from sqlalchemy.engine import URL

from catalog import (
    attempts,
    audit,
    claims,
    queries,
    repairs,
    replicas,
    runs,
    schema,
    transitions,
    validate,
)
from catalog.audit import default_actor, record_event
from catalog.engine import Database
from catalog.errors import CheckpointRecordNotFoundError, InvalidValueError
from catalog.models import Checkpoint, CheckpointState, Event, RunKind, RunStatus
from catalog.records import (
    AttemptRecord,
    AttemptRegistration,
    CheckpointRecord,
    EventRecord,
    RunRecord,
    RunSummary,
)
from catalog.repairs import SyncOutcome
from catalog.retention import DEFAULT_GRACE, RetentionPlan, validate_policy
from catalog.runs import UNSET, _Unset

__all__ = ["DEFAULT_GRACE", "MISSING_MARKER_REASON", "Catalog"]

MISSING_MARKER_REASON = "commit marker missing on storage"
#: events deleted per transaction by ``prune_events``: about 45 ms on PostgreSQL and 0.25 s on
#: SQLite (its write lock) in a 10M-event log, so savers wait at most that long for a batch
PRUNE_BATCH = 10_000

OptionalInt = int | None | _Unset


def _now() -> datetime:
    return datetime.now(UTC)


class Catalog(replicas.ReplicaMethods):
    """The catalog of runs and checkpoints in one SQLite or PostgreSQL database.

    Save timings (``add_timings``) and checkpoint replicas per storage tier
    (``replica_started``, ``replica_committed``, ``replica_failed``, ``replica_deleted``,
    ``replicas``) are methods of ``catalog.replicas.ReplicaMethods``, mixed in here.

    ``Catalog(url)`` connects, creates an empty database at the schema head, and refuses a
    database it cannot use with the ``SchemaError`` that says why (``catalog.schema``): a
    revision behind (``SchemaOutdatedError`` naming ``zephon db upgrade``) or unknown, tables
    that differ from the recorded revision (``SchemaDriftError``), tables without a recorded
    revision (``SchemaUnversionedError``). The check costs two small queries.
    ``check_schema=False`` skips it, for ``upgrade()`` and ``current_revision()`` (the
    ``zephon db`` commands), which make their own. ``actor`` overrides the
    ``user@host:pid`` recorded in events.
    """

    def __init__(
        self, url: str | URL, *, actor: str | None = None, check_schema: bool = True
    ) -> None:
        if actor is not None:
            # The claim token is "<actor>/<12 hex>" in a 255-character column.
            validate.text("actor", actor, maximum=242)
        self._db = Database(url)
        self._actor = actor
        if check_schema:
            try:
                schema.ensure_schema(self._db)
            except BaseException:
                self._db.dispose()
                raise

    # -- lifecycle and schema ----------------------------------------------------------------

    @property
    def url(self) -> str:
        """The database URL with the password masked."""
        return self._db.url

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._db.dialect

    def close(self) -> None:
        """Release the connection pool. Idempotent."""
        self._db.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Catalog({self.url!r})"

    def upgrade(self) -> tuple[str | None, str]:
        """Migrate the schema to head (``zephon db upgrade``); ``(before, after)`` revisions."""
        return schema.upgrade_schema(self._db)

    def current_revision(self) -> str | None:
        """The verified schema revision (``zephon db current``): None if no catalog was
        created yet; raises the ``SchemaError`` explaining a schema this code cannot use."""
        return schema.current_revision(self._db)

    @staticmethod
    def head_revision() -> str:
        """The schema revision this code needs."""
        return schema.head_revision()

    def _event(
        self,
        session: Any,
        action: str,
        run: str | None = None,
        step: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        actor = self._actor or default_actor()
        record_event(session, action, run=run, step=step, detail=detail, actor=actor)

    def record_event(
        self,
        action: str,
        *,
        run: str | None = None,
        step: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        """Append an event for something done outside the catalog (e.g. gc removed an orphan)."""
        validate.text("event action", action, maximum=32)
        if run is not None:
            validate.run_name(run)
        validate.optional_step("step", step)
        validate.json_document("detail", detail)
        with self._db.write(f"record event {action}") as session:
            self._event(session, action, run, step, detail)

    def events(self, *, run: str | None = None, limit: int = 100) -> list[EventRecord]:
        """The newest ``limit`` events, newest first, optionally of one run."""
        validate.limit(limit)
        statement = select(Event).order_by(Event.at.desc(), Event.id.desc()).limit(limit)
        if run is not None:
            statement = statement.where(Event.run_name == validate.run_name(run))
        with self._db.read("list events") as session:
            return [EventRecord.of(row) for row in session.scalars(statement)]

    def prune_events(
        self,
        *,
        older_than: timedelta,
        now: datetime | None = None,
        batch_size: int = PRUNE_BATCH,
    ) -> int:
        """Delete the events older than ``now - older_than``; returns how many were deleted.

        Deletes in batches of ``batch_size`` (oldest first), each its own transaction, so a
        huge log never becomes one giant transaction and other writers (jobs saving, gc) get
        the database between batches. The last batch's transaction records one
        ``events_pruned`` event (detail: ``before``, the cut-off; ``deleted``; ``batches``), so
        the log says when it was pruned, and that event is newer than the cut-off it names.
        A crash part-way leaves the batches done deleted and no ``events_pruned`` event;
        calling again finishes the job. For ``zephon gc``; any process may call it at any time.
        """
        validate.duration("older_than", older_than)
        validate.integer("batch_size", batch_size, minimum=1, maximum=1_000_000)
        cutoff = (validate.aware("now", now) if now is not None else _now()) - older_than
        deleted, batches = 0, 0
        while True:
            with self._db.write("prune events") as session:
                count = audit.delete_before(session, cutoff, batch_size)
                deleted, batches = deleted + count, batches + 1
                if count < batch_size:
                    detail = {
                        "before": cutoff.isoformat(),
                        "deleted": deleted,
                        "batches": batches,
                    }
                    self._event(session, "events_pruned", detail=detail)
                    return deleted

    # -- runs --------------------------------------------------------------------------------

    def create_run(
        self,
        name: str,
        storage_url: str,
        *,
        kind: str = RunKind.TRAIN,
        status: str = RunStatus.ACTIVE,
        total_steps: int | None = None,
        num_to_keep: int | None = None,
        keep_every_steps: int | None = None,
        config: dict[str, Any] | None = None,
    ) -> RunRecord:
        """Register a new run; ``RunExistsError`` if the name is taken."""
        values = self._run_values(
            dict(
                storage_url=storage_url,
                kind=kind,
                status=status,
                total_steps=total_steps,
                num_to_keep=num_to_keep,
                keep_every_steps=keep_every_steps,
                config=config,
            )
        )
        name = validate.run_name(name)
        with self._db.write(f"create run {name!r}") as session:
            run = runs.create(session, self.url, name, values, _now())
            self._event(session, "run_created", name, detail=_run_detail(values))
            return RunRecord.of(run)

    def ensure_run(
        self,
        name: str,
        storage_url: str,
        *,
        kind: str = RunKind.TRAIN,
        status: str | _Unset = UNSET,
        total_steps: OptionalInt = UNSET,
        num_to_keep: OptionalInt = UNSET,
        keep_every_steps: OptionalInt = UNSET,
        config: dict[str, Any] | None | _Unset = UNSET,
    ) -> RunRecord:
        """Get the run, creating it if missing; the call a job makes at start-up.

        ``storage_url`` and ``kind`` identify the run: an existing run with other values raises
        ``RunConflictError``. Fields given (not ``UNSET``) are applied to an existing run, so a
        job's configuration stays authoritative; a new run gets them, or the defaults (status
        active, no total, keep all, no milestones, no config). Idempotent.
        """
        name = validate.run_name(name)
        identity = self._run_values({"storage_url": storage_url, "kind": kind})
        changes = self._given_changes(status, total_steps, num_to_keep, keep_every_steps, config)
        defaults = {"status": RunStatus.ACTIVE.value}
        with self._db.write(f"ensure run {name!r}") as session:
            run, created, changed = runs.ensure(
                session, self.url, name, identity, changes, defaults, _now()
            )
            if created:
                self._event(session, "run_created", name, detail=_run_detail(identity | changes))
            elif changed:
                self._event(session, "run_updated", name, detail=_run_detail(changed))
            return RunRecord.of(run)

    def update_run(
        self,
        name: str,
        *,
        status: str | _Unset = UNSET,
        total_steps: OptionalInt = UNSET,
        num_to_keep: OptionalInt = UNSET,
        keep_every_steps: OptionalInt = UNSET,
        config: dict[str, Any] | None | _Unset = UNSET,
        epoch: int | None = None,
    ) -> RunRecord:
        """Change the given fields of a run (``RunNotFoundError`` if missing).

        With ``epoch`` (a job updating its own run) the call is fenced: ``FencedOutError``
        unless it is the run's current epoch, so a superseded job cannot, say, mark the run
        finished under its successor. On PostgreSQL this waits for deletion claims in flight
        on the run, so a claim never decides on a retention policy that is being changed.
        """
        name = validate.run_name(name)
        changes = self._given_changes(status, total_steps, num_to_keep, keep_every_steps, config)
        if epoch is not None:
            epoch = validate.epoch(epoch)
        with self._db.write(f"update run {name!r}") as session:
            run = runs.require(session, self.url, name, lock="update")
            if epoch is not None:
                attempts.check_current(session, self.url, run, epoch)
            changed = runs.apply_changes(run, changes, _now())
            if changed:
                self._event(session, "run_updated", name, detail=_run_detail(changed))
            return RunRecord.of(run)

    def get_run(self, name: str) -> RunRecord:
        """The run (``RunNotFoundError`` if missing)."""
        name = validate.run_name(name)
        with self._db.read(f"read run {name!r}") as session:
            return RunRecord.of(runs.require(session, self.url, name))

    def list_runs(self, *, status: str | None = None) -> list[RunSummary]:
        """Every run by name, with committed count/bytes, latest step (and its timings),
        pending count and last activity, computed in one query (``zephon runs``)."""
        if status is not None:
            status = validate.status(status)
        with self._db.read("list runs") as session:
            return [
                RunSummary(
                    run=RunRecord.of(row.run),
                    committed_count=row.committed_count,
                    committed_bytes=row.committed_bytes,
                    latest_step=row.latest_step,
                    pending_count=row.pending_count,
                    last_activity=max(filter(None, (row.run.updated_at, row.last_update))),
                    latest_timings=row.latest_timings,
                )
                for row in runs.summaries(session, status)
            ]

    def _given_changes(
        self,
        status: str | _Unset,
        total_steps: OptionalInt,
        num_to_keep: OptionalInt,
        keep_every_steps: OptionalInt,
        config: dict[str, Any] | None | _Unset,
    ) -> dict[str, Any]:
        """The validated run fields a caller gave (those not ``UNSET``)."""
        given = {
            "status": status,
            "total_steps": total_steps,
            "num_to_keep": num_to_keep,
            "keep_every_steps": keep_every_steps,
            "config": config,
        }
        return self._run_values({k: v for k, v in given.items() if v is not UNSET})

    def _run_values(self, values: dict[str, Any]) -> dict[str, Any]:
        checks = {
            "storage_url": lambda v: validate.storage_url("storage_url", v),
            "kind": validate.kind,
            "status": validate.status,
            "total_steps": validate.total_steps,
            "config": lambda v: validate.json_document("config", v),
        }
        checked = {k: checks[k](v) if k in checks else v for k, v in values.items()}
        validate_policy(checked.get("num_to_keep"), checked.get("keep_every_steps"))
        return checked

    # -- attempts: fencing -------------------------------------------------------------------

    def register_attempt(
        self,
        run: str,
        *,
        epoch: int,
        attempt_id: str,
        host: str,
        pid: int,
        started_at: datetime,
        resumed_from: int | None | _Unset = UNSET,
    ) -> AttemptRegistration:
        """Make a new start of a job the run's current attempt, and abandon what it discards.

        ``epoch`` is the attempt's fencing token from storage (>= 1, above every earlier one),
        ``attempt_id`` its uuid hex, ``host``/``pid``/``started_at`` its process,
        ``resumed_from`` the step it resumed from (None: a fresh start). In one transaction,
        holding the run row's update lock: refuse with ``FencedOutError`` (naming the
        current attempt) unless ``epoch`` is above the run's epoch; insert the attempt; set the
        run's epoch; and move every row of an older attempt above ``resumed_from`` (every step
        for a fresh start) that is pending, committed or failed to ``stale``. The step
        ``resumed_from`` itself stays. Fenced calls of older epochs are refused from then on.

        Without ``resumed_from`` the attempt is registered *undecided*: it fences older
        attempts at once and abandons nothing; ``decide_resume`` records its resume point
        later, once it has chosen under the fence (nothing an older attempt does can then move
        the ground under that choice).

        Calling it again for the current attempt (same epoch and attempt id, a retry) returns
        it with nothing abandoned. ``RunNotFoundError`` without the run.
        """
        run = validate.run_name(run)
        values = {
            "epoch": validate.epoch(epoch, minimum=1),
            "attempt_id": validate.token("attempt_id", attempt_id),
            "host": validate.host(host),
            "pid": validate.pid(pid),
            "started_at": validate.aware("started_at", started_at),
        }
        if resumed_from is not UNSET:
            values["resumed_from"] = validate.optional_step("resumed_from", resumed_from)
        with self._db.write(f"register attempt {epoch} of run {run!r}") as session:
            owner = runs.require(session, self.url, run, lock="update")
            row, abandoned, registered = attempts.register(session, self.url, owner, values, _now())
            if registered:
                detail = {k: v for k, v in values.items() if k != "started_at"}
                detail["started_at"] = started_at.isoformat()
                detail["abandoned"] = abandoned
                self._event(session, "attempt_registered", run, detail=detail)
            return AttemptRegistration(AttemptRecord.of(row, run), tuple(abandoned))

    def decide_resume(
        self, run: str, *, epoch: int, resumed_from: int | None
    ) -> AttemptRegistration:
        """The current attempt ``epoch`` (registered undecided) resumes from ``resumed_from``
        (None: a fresh start). Fenced: ``FencedOutError`` unless ``epoch`` is current. In
        the same transaction every older attempt's pending, committed or failed row above it
        moves to ``stale``. Deciding the same again is a no-op; a different second decision
        raises ``InvalidValueError`` (a new resume point needs a new attempt)."""
        run = validate.run_name(run)
        epoch = validate.epoch(epoch, minimum=1)
        resumed_from = validate.optional_step("resumed_from", resumed_from)
        with self._db.write(f"decide the resume point of run {run!r}") as session:
            owner = runs.require(session, self.url, run, lock="update")
            row, abandoned, changed = attempts.decide(
                session, self.url, owner, epoch, resumed_from, _now()
            )
            if changed:
                detail = {"epoch": epoch, "resumed_from": resumed_from, "abandoned": abandoned}
                self._event(session, "resume_decided", run, detail=detail)
            return AttemptRegistration(AttemptRecord.of(row, run), tuple(abandoned))

    def current_attempt(self, run: str) -> AttemptRecord | None:
        """The run's current attempt; None if it never had a fenced one (epoch 0)."""
        run = validate.run_name(run)
        with self._db.read(f"read the current attempt of run {run!r}") as session:
            return attempts.current_record(session, runs.require(session, self.url, run))

    def list_attempts(self, run: str) -> list[AttemptRecord]:
        """Every registered attempt of the run, ascending epoch."""
        run = validate.run_name(run)
        with self._db.read(f"list attempts of run {run!r}") as session:
            owner = runs.require(session, self.url, run)
            return [AttemptRecord.of(row, run) for row in attempts.all_of(session, owner)]

    # -- checkpoints: the save path ------------------------------------------------------

    def begin_checkpoint(
        self, run: str, step: int, path: str, *, epoch: int = 0, save_id: str | None = None
    ) -> CheckpointRecord:
        """Arm ``(run, step)`` as ``pending`` before writing it; the record's ``save_id`` is
        what ``mark_committed``/``mark_failed`` need.

        Fenced: refused with ``FencedOutError`` unless ``epoch`` is the run's current epoch
        (epoch 0 works only while the run never had a fenced attempt). ``save_id`` (1-64
        characters of ``[A-Za-z0-9_-]``) names the save, e.g. the id storage writes into the
        marker; without it one is generated. The row records ``epoch``.

        A missing row is created; a ``failed``, ``deleted``, ``stale``, ``corrupt`` or
        ``pending`` one (a crashed earlier save) is re-armed under the new save id, which makes
        the older save's later ``mark_committed`` fail with ``StateConflictError``; the event's
        ``previous`` keeps what the row was. Raises ``CheckpointExistsError`` for a
        ``committed`` step (never overwritten) and ``InvalidTransitionError`` for one gc is
        deleting; ``RunNotFoundError`` without the run.
        """
        run, step = validate.run_name(run), validate.step(step)
        path = validate.storage_url("path", path)
        epoch = validate.epoch(epoch)
        if save_id is not None:
            save_id = validate.token("save_id", save_id)
        with self._db.write(f"begin run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run, lock="share")
            attempts.check_current(session, self.url, owner, epoch)
            row, action, previous = transitions.begin(
                session, self.url, owner, step, path, epoch, save_id, _now()
            )
            detail: dict[str, Any] = {"save_id": row.save_id, "epoch": epoch, "path": path}
            if previous is not None:
                detail["previous"] = previous
            self._event(session, action, run, step, detail)
            return CheckpointRecord.of(row, run)

    def mark_committed(
        self,
        run: str,
        step: int,
        save_id: str,
        *,
        epoch: int = 0,
        bytes: int | None,
        file_count: int | None,
        manifest_checksum: str | None,
        metadata: dict[str, Any] | None = None,
        timings: Mapping[str, float] | None = None,
    ) -> CheckpointRecord:
        """``pending -> committed`` after the commit marker is written, for this save only.

        ``timings`` (phase name -> seconds: ``write_s``, ``commit_s``, ``total_s``,
        ``stall_s``...; ``catalog.validate.TIMING_PHASES``) are merged into the row's, in the
        same transaction, also when the call is an idempotent repeat.

        Idempotent: if the row is already committed by the same save (a retry, or the marker
        probe promoted it), returns it unchanged, even if a newer attempt has registered since
        (the commit happened while this attempt was current). Otherwise fenced like
        ``begin_checkpoint``: ``FencedOutError`` unless ``epoch`` is the run's current
        epoch. Raises ``StateConflictError`` when the row is no longer this save's pending row
        (re-armed by a newer save, failed by gc after the grace period),
        ``InvalidTransitionError`` when the save was begun by another attempt (only the
        attempt that began a save commits it), ``CheckpointRecordNotFoundError`` without a row.
        """
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        epoch = validate.epoch(epoch)
        facts = _facts(bytes, file_count, manifest_checksum, metadata)
        phases = validate.timings(timings)
        with self._db.write(f"commit run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run, lock="share")
            done = transitions.committed_by(session, owner.id, step, save_id)
            if done is not None:
                if phases:
                    done = replicas.merge_timings(session, [Checkpoint.id == done.id], phases)
                return CheckpointRecord.of(done, run)
            attempts.check_current(session, self.url, owner, epoch)
            if phases:  # merged in the commit's own guarded UPDATE
                facts["timings"] = replicas.merged_timings(session, phases)
            row, moved = transitions.commit(
                session, self.url, owner, step, save_id, epoch, facts, _now()
            )
            if moved:
                detail: dict[str, Any] = {
                    "save_id": save_id,
                    "epoch": epoch,
                    "bytes": bytes,
                    "file_count": file_count,
                    "manifest_checksum": manifest_checksum,
                }
                if phases:
                    detail["timings"] = phases
                self._event(session, "committed", run, step, detail)
            return CheckpointRecord.of(row, run)

    def mark_failed(self, run: str, step: int, save_id: str, reason: str) -> CheckpointRecord:
        """``pending -> failed`` for this save: the save failed, or gc expired a stale row.

        Not fenced: failing one's own pending row is harmless whatever attempt is current.
        Idempotent for the same save; ``StateConflictError`` if the row moved on (committed,
        re-armed by a newer save, or made stale by a newer attempt). The directory left behind
        has no marker and is removed by gc as an orphan.
        """
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        reason = validate.reason("reason", reason, empty=True)
        with self._db.write(f"fail run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row, moved = transitions.fail(session, self.url, owner, step, save_id, reason, _now())
            if moved:
                self._event(session, "failed", run, step, {"save_id": save_id, "reason": reason})
            return CheckpointRecord.of(row, run)

    # -- checkpoints: queries ------------------------------------------------------------

    def latest_committed(self, run: str) -> CheckpointRecord | None:
        """The newest committed checkpoint of ``run`` (highest step), or None.

        One indexed query (a backward scan of ``(run_id, state, step)`` stopping at the first
        entry); a second query only when there is none, to tell an unknown run
        (``RunNotFoundError``) from a run without committed checkpoints (None).
        """
        run = validate.run_name(run)
        statement = queries.latest_committed(run)
        with self._db.read(f"find the latest checkpoint of run {run!r}") as session:
            row = session.scalars(statement).first()
            if row is not None:
                return CheckpointRecord.of(row, run)
            runs.require(session, self.url, run)
            return None

    def rows_after(
        self, run: str, step: int | None, *, states: str | Sequence[str]
    ) -> list[CheckpointRecord]:
        """Rows in ``states`` with a step above ``step`` (every step if None), newest first.

        For the marker probe on resume: pass the latest committed step and the states
        pending, failed and deleted; a row whose verified marker exists on storage is repaired
        with ``upsert_committed`` (the marker's save id and epoch).
        """
        run = validate.run_name(run)
        if step is not None:
            step = validate.step(step)
        wanted = validate.states(states)
        if not wanted:
            raise InvalidValueError("states", states, "expected at least one state")
        with self._db.read(f"list checkpoints of run {run!r} after step {step}") as session:
            owner = runs.require(session, self.url, run)
            statement = queries.rows_after(owner.id, step, wanted)
            return [CheckpointRecord.of(row, run) for row in session.scalars(statement)]

    def pending_after(self, run: str, step: int | None) -> list[CheckpointRecord]:
        """``rows_after(run, step, states=["pending"])``."""
        return self.rows_after(run, step, states=[CheckpointState.PENDING])

    def list_checkpoints(
        self, run: str, *, states: str | Sequence[str] | None = None
    ) -> list[CheckpointRecord]:
        """The run's checkpoints in ascending step order, optionally only in ``states``."""
        run = validate.run_name(run)
        wanted = validate.states(states)
        with self._db.read(f"list checkpoints of run {run!r}") as session:
            owner = runs.require(session, self.url, run)
            statement = queries.checkpoints_of(owner.id, wanted)
            return [CheckpointRecord.of(row, run) for row in session.scalars(statement)]

    def get_checkpoint(self, run: str, step: int) -> CheckpointRecord:
        """One checkpoint row in any state (``CheckpointRecordNotFoundError`` if none)."""
        run, step = validate.run_name(run), validate.step(step)
        with self._db.read(f"read run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row = transitions.load(session, owner.id, step)
            if row is None:
                raise CheckpointRecordNotFoundError(self.url, run, step)
            return CheckpointRecord.of(row, run)

    # -- pins ------------------------------------------------------------------------------

    def pin(self, run: str, step: int) -> CheckpointRecord:
        """Keep this checkpoint whatever the retention policy. Only pending or committed rows
        can be pinned (``InvalidTransitionError`` otherwise, e.g. while gc deletes it)."""
        return self._set_pinned(run, step, True)

    def unpin(self, run: str, step: int) -> CheckpointRecord:
        """Let retention decide about this checkpoint again. Idempotent, any state."""
        return self._set_pinned(run, step, False)

    def _set_pinned(self, run: str, step: int, pinned: bool) -> CheckpointRecord:
        run, step = validate.run_name(run), validate.step(step)
        action = "pinned" if pinned else "unpinned"
        verb = "pin" if pinned else "unpin"
        with self._db.write(f"{verb} run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row, changed = transitions.set_pinned(session, self.url, owner, step, pinned, _now())
            if changed:
                self._event(session, action, run, step)
            return CheckpointRecord.of(row, run)

    # -- sync: repairing the index from storage --------------------------------------------

    def upsert_committed(
        self,
        run: str,
        step: int,
        path: str,
        *,
        save_id: str,
        epoch: int,
        bytes: int | None,
        file_count: int | None,
        manifest_checksum: str | None,
        metadata: dict[str, Any] | None = None,
        committed_at: datetime | None = None,
    ) -> tuple[CheckpointRecord | None, SyncOutcome]:
        """Storage holds a complete, verified marker of save ``save_id`` (attempt ``epoch``) at
        ``step``: make the catalog agree. Idempotent; used by the resume probe, gc and sync.

        Never promotes a marker whose attempt is unregistered (epoch above the run's) or whose
        ``(epoch, step)`` a newer attempt abandoned (it resumed from below ``step``, or started
        fresh): ``SyncOutcome.STALE``, and a row still holding that save live is made
        ``stale``. Otherwise: no row -> ``INSERTED``; pending with the same save, failed or
        deleted -> ``PROMOTED``; committed -> ``UNCHANGED`` or ``UPDATED`` (a different save's
        row takes the marker's save, epoch and facts: storage is the truth); pending with
        another save (a live newer save), stale, corrupt or deleting -> ``SKIPPED``.
        ``committed_at`` defaults to now; ``metadata=None`` keeps the row's.

        Holds the run row's update lock, like ``mark_missing``: the lineage it checks must not
        change before it commits, and it may take a committed row out of retention's count.
        """
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        epoch = validate.epoch(epoch)
        facts = {
            "path": validate.storage_url("path", path),
            **_facts(bytes, file_count, manifest_checksum, metadata),
        }
        if metadata is None:
            del facts["meta"]  # unknown here: keep what the row has
        if committed_at is not None:
            validate.aware("committed_at", committed_at)
        now = _now()
        with self._db.write(f"sync run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run, lock="update")
            row, outcome, changed = repairs.upsert_committed(
                session, owner, step, save_id, epoch, facts, committed_at or now, now
            )
            if changed:
                detail = {"path": path, "save_id": save_id, "epoch": epoch}
                action = "sync_staled" if outcome is SyncOutcome.STALE else f"sync_{outcome}"
                self._event(session, action, run, step, detail)
            return (CheckpointRecord.of(row, run) if row is not None else None), outcome

    def mark_missing(self, run: str, step: int, reason: str = MISSING_MARKER_REASON) -> bool:
        """``committed -> deleted`` for a checkpoint whose marker is gone from storage.

        For ``zephon sync``. Returns True if the row moved, False if it was not committed
        (pending rows may still be written; ``deleting`` ones belong to gc). The leftover
        payload, if any, has no marker and is removed by gc as an orphan.
        """
        run, step = validate.run_name(run), validate.step(step)
        reason = validate.reason("reason", reason)
        with self._db.write(f"mark run {run!r} step {step} missing") as session:
            owner = runs.require(session, self.url, run, lock="update")
            now = _now()
            row = repairs.mark_missing(session, owner, step, reason, now)
            if row is not None:
                self._event(session, "marked_missing", run, step, {"reason": reason})
                replicas.save_dir_copy_gone(session, owner.id, step, now)
            return row is not None

    def mark_corrupt(self, run: str, step: int, save_id: str, reason: str) -> bool:
        """The stored checkpoint of save ``save_id`` failed verification: row -> ``corrupt``.

        Not fenced: any reader may find corruption. Moves the row of that save when it is
        pending, committed, failed, or deleted by sync (marker missing); ``reason`` goes to
        ``failure_reason``. A corrupt row is never latest, never counted by retention, and kept
        for inspection until gc deletes it with ``corrupt=True``; a new save of the step
        re-arms it. Returns True if the row moved; False if it holds another save, is already
        corrupt or stale, or is being (or was) deleted by gc, whose files are going or gone.
        Holds the run row's update lock, as ``mark_missing`` does.
        """
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        reason = validate.reason("reason", reason)
        with self._db.write(f"mark run {run!r} step {step} corrupt") as session:
            owner = runs.require(session, self.url, run, lock="update")
            row = repairs.mark_corrupt(session, owner, step, save_id, reason, _now())
            if row is not None:
                detail = {"save_id": save_id, "reason": reason}
                self._event(session, "marked_corrupt", run, step, detail)
            return row is not None

    def mark_stale(self, run: str, step: int, save_id: str, reason: str) -> bool:
        """The stored marker of save ``save_id`` belongs to a history the run's lineage
        abandoned (an attempt this catalog learnt of late, an unregistered epoch): row ->
        ``stale``. Never latest again; gc deletes it after the grace. Not fenced: any reader
        applying the lineage rule may find it. True if the row moved (pending, committed or
        failed rows of that save); False otherwise."""
        run, step = validate.run_name(run), validate.step(step)
        save_id = validate.token("save_id", save_id)
        reason = validate.reason("reason", reason)
        with self._db.write(f"mark run {run!r} step {step} stale") as session:
            owner = runs.require(session, self.url, run, lock="update")
            row = repairs.mark_stale(session, owner, step, save_id, reason[:2000], _now())
            if row is not None:
                self._event(
                    session, "marked_stale", run, step, {"save_id": save_id, "reason": reason}
                )
            return row is not None

    # -- retention and deletion ------------------------------------------------------------

    def retention_plan(
        self,
        run: str,
        *,
        grace: timedelta = DEFAULT_GRACE,
        pending_grace: timedelta = DEFAULT_GRACE,
        corrupt: bool = False,
        now: datetime | None = None,
    ) -> RetentionPlan:
        """``plan_retention`` over the run's committed, pending, stale and corrupt rows, with
        its policy and the current attempt's resume point (always kept).

        ``grace``: how long stale rows stay; ``pending_grace``: how long a pending row may take
        to commit before it is expired (never ``grace``: gc with a zero grace must not expire a
        save in progress); ``corrupt=True`` plans corrupt rows for deletion. Advisory: nothing
        is changed. Act on ``to_delete`` with ``claim_for_deletion`` and the same ``grace``
        and ``corrupt`` (it re-plans), and on ``to_expire`` by probing the marker, then
        ``upsert_committed`` or ``mark_failed`` with the decision's ``save_id``.
        """
        run = validate.run_name(run)
        validate.duration("grace", grace)
        validate.duration("pending_grace", pending_grace)
        now = validate.aware("now", now) if now is not None else _now()
        with self._db.read(f"plan retention of run {run!r}") as session:
            owner = runs.require(session, self.url, run)
            return claims.current_plan(
                session,
                owner,
                now,
                grace=grace,
                pending_grace=pending_grace,
                corrupt=bool(corrupt),
            )

    def claim_for_deletion(
        self,
        run: str,
        steps: Sequence[int],
        *,
        epoch: int | None = None,
        corrupt: bool = False,
        grace: timedelta = DEFAULT_GRACE,
        lease: timedelta = claims.DEFAULT_LEASE,
        now: datetime | None = None,
        requested: bool = False,
    ) -> list[CheckpointRecord]:
        """Move the given steps to ``deleting`` for this caller; returns the rows won.

        Only rows the run's retention plan deletes *now* are claimed: the plan is re-made in
        this transaction with the current rows, policy and resume point, ``grace`` and
        ``corrupt`` (pass the values the caller planned with). That is committed rows the
        policy no longer keeps, stale rows stale for longer than ``grace``, corrupt rows when
        ``corrupt=True``; the current attempt's resume point is never claimed. With
        ``requested`` (a framework's retention naming the steps it no longer wants, such as
        Lightning's ``save_top_k``) the given committed, stale or corrupt rows are claimed
        whatever the policy says, except pinned ones and the resume point. ``deleting``
        rows whose lease is older than ``lease`` or was released are re-claimed (a crashed or
        failed gc). Rows locked or
        claimed by a concurrent gc, kept by the fresh plan, or in other states are silently
        left out: losing is normal, not an error.

        With ``epoch`` (a job applying its own retention) the call is fenced in the same
        transaction: ``FencedOutError`` unless it is the run's current epoch. Each returned
        record's ``claimed_by`` is the token ``mark_deleted`` needs. Then delete from storage
        (marker first) and ``mark_deleted``.
        """
        run = validate.run_name(run)
        steps = [validate.step(s) for s in steps]
        if epoch is not None:
            epoch = validate.epoch(epoch)
        validate.duration("grace", grace)
        validate.positive_duration("lease", lease)
        token = f"{self._actor or default_actor()}/{transitions.new_save_id()[:12]}"
        now = validate.aware("now", now) if now is not None else _now()
        with self._db.write(f"claim checkpoints of run {run!r} for deletion") as session:
            owner = runs.require(session, self.url, run, lock="share")
            if epoch is not None:
                attempts.check_current(session, self.url, owner, epoch)
            won = claims.claim(
                session,
                owner,
                steps,
                token,
                now,
                lease,
                grace=grace,
                corrupt=bool(corrupt) or bool(requested),
                requested=bool(requested),
            )
            for row, action, was in won:
                self._event(session, action, run, row.step, {"claim": token, "from": was})
            return [CheckpointRecord.of(row, run) for row, _, _ in won]

    def mark_deleted(self, run: str, step: int, claim_token: str) -> bool:
        """``deleting -> deleted`` once storage no longer holds the checkpoint.

        True if this claim finished it; False if the claim was taken over after its lease
        expired (the other gc finishes it; deleting twice from storage is harmless).
        """
        run, step = validate.run_name(run), validate.step(step)
        claim_token = validate.text("claim_token", claim_token, maximum=255)
        with self._db.write(f"mark run {run!r} step {step} deleted") as session:
            owner = runs.require(session, self.url, run)
            now = _now()
            row = claims.finish(session, owner, step, claim_token, now)
            if row is not None:
                self._event(session, "deleted", run, step, {"claim": claim_token})
                replicas.save_dir_copy_gone(session, owner.id, step, now)
            return row is not None

    def release_claims(self, run: str, tokens: Sequence[str], reason: str) -> list[int]:
        """End the leases of the run's ``deleting`` rows held by ``tokens`` (a delete that
        failed, or a holder proved dead), so that the next gc re-claims and finishes them at
        once; the rows stay ``deleting``. Returns the steps released (event ``released``)."""
        run = validate.run_name(run)
        tokens = [validate.text("claim_token", t, maximum=255) for t in tokens]
        reason = validate.text("reason", reason)
        if not tokens:
            return []
        with self._db.write(f"release deletion claims of run {run!r}") as session:
            owner = runs.require(session, self.url, run)
            rows = claims.release(session, owner, tokens, _now())
            for row in rows:
                detail = {"claim": row.claimed_by, "reason": reason}
                self._event(session, "released", run, row.step, detail)
            return sorted(row.step for row in rows)

    def expired_claims(
        self,
        *,
        run: str | None = None,
        lease: timedelta = claims.DEFAULT_LEASE,
        now: datetime | None = None,
    ) -> list[CheckpointRecord]:
        """``deleting`` rows whose lease is older than ``lease`` (a gc died mid-delete) or was
        released (``release_claims``: ``claimed_at`` is None), of one run or all; pass their
        steps to ``claim_for_deletion`` to finish them."""
        if run is not None:
            run = validate.run_name(run)
        validate.positive_duration("lease", lease)
        cutoff = (validate.aware("now", now) if now is not None else _now()) - lease
        with self._db.read("list expired deletion claims") as session:
            run_id = None
            if run is not None:
                run_id = runs.require(session, self.url, run).id
            return [
                CheckpointRecord.of(row, name)
                for row, name in claims.expired_claims(session, run_id, cutoff)
            ]


def _facts(
    bytes: int | None,
    file_count: int | None,
    manifest_checksum: str | None,
    metadata: dict[str, Any] | None,
) -> dict[str, Any]:
    validate.byte_count(bytes)
    validate.file_count(file_count)
    if manifest_checksum is not None:
        validate.text("manifest_checksum", manifest_checksum, maximum=128)
    validate.json_document("metadata", metadata)
    return {
        "bytes": bytes,
        "file_count": file_count,
        "manifest_checksum": manifest_checksum,
        "meta": metadata,
    }


def _run_detail(values: dict[str, Any]) -> dict[str, Any]:
    # The full config can be large; the event says that it changed, the run row holds it.
    return {k: ("<changed>" if k == "config" else v) for k, v in values.items()}
