"""``Catalog``: the one object callers use. Validates arguments, runs each call in its own
transaction, records an audit event for every change, and returns frozen records.

Concurrency: every method is one short transaction, so one ``Catalog`` may be shared by the
threads of a process, and any number of processes (jobs, ``zephon gc``, ``zephon sync``) may
use the same database at once; the guarantees are those of the guarded transitions
(``catalog.transitions``) and of the claim protocol (``catalog.claims``). A ``Catalog`` must
not cross a ``fork()``: each process opens its own.

Errors: argument problems raise ``InvalidValueError`` before any database work; database
problems raise ``CatalogUnavailableError``/``CatalogDatabaseError``; everything else is one of
the specific ``CatalogError`` subclasses documented per method. Messages mask the password.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Self

from sqlalchemy import select
from sqlalchemy.engine import URL

from catalog import claims, queries, runs, schema, transitions, validate
from catalog.audit import default_actor, record_event
from catalog.engine import Database
from catalog.errors import CheckpointNotFoundError, InvalidValueError
from catalog.models import CheckpointState, Event, RunKind, RunStatus
from catalog.records import CheckpointRecord, EventRecord, RunRecord, RunSummary
from catalog.retention import RetentionPlan, plan_retention, validate_policy
from catalog.runs import UNSET, _Unset
from catalog.transitions import SyncOutcome

DEFAULT_GRACE = timedelta(hours=24)
MISSING_MARKER_REASON = "commit marker missing on storage"

OptionalInt = int | None | _Unset


def _now() -> datetime:
    return datetime.now(UTC)


class Catalog:
    """The catalog of runs and checkpoints in one SQLite or PostgreSQL database.

    ``Catalog(url)`` connects, creates an empty database at the schema head, and refuses a
    database whose schema differs from this code's (``SchemaOutdatedError`` naming
    ``zephon db upgrade``). ``check_schema=False`` skips that, for ``upgrade()`` and
    ``current_revision()`` (the ``zephon db`` commands). ``actor`` overrides the
    ``user@host:pid`` recorded in events.
    """

    def __init__(
        self, url: str | URL, *, actor: str | None = None, check_schema: bool = True
    ) -> None:
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
        """The database's schema revision (``zephon db current``); None if never created."""
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
        if not action or len(action) > 32:
            raise InvalidValueError("event action", action, "expected 1-32 characters")
        with self._db.write(f"record event {action}") as session:
            self._event(session, action, run, step, detail)

    def events(self, *, run: str | None = None, limit: int = 100) -> list[EventRecord]:
        """The newest ``limit`` events, newest first, optionally of one run."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidValueError("limit", limit, "expected an integer >= 1")
        statement = select(Event).order_by(Event.at.desc(), Event.id.desc()).limit(limit)
        if run is not None:
            statement = statement.where(Event.run_name == validate.run_name(run))
        with self._db.read("list events") as session:
            return [EventRecord.of(row) for row in session.scalars(statement)]

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
    ) -> RunRecord:
        """Change the given fields of a run (``RunNotFoundError`` if missing).

        On PostgreSQL this waits for deletion claims in flight on the run, so a claim never
        decides on a retention policy that is being changed.
        """
        name = validate.run_name(name)
        changes = self._given_changes(status, total_steps, num_to_keep, keep_every_steps, config)
        with self._db.write(f"update run {name!r}") as session:
            run = runs.require(session, self.url, name, lock="update")
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
        """Every run by name, with committed count/bytes, latest step, pending count and last
        activity, computed in one query (``zephon runs``)."""
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
            "total_steps": lambda v: validate.optional_count("total_steps", v),
            "config": _check_config,
        }
        checked = {k: checks[k](v) if k in checks else v for k, v in values.items()}
        validate_policy(checked.get("num_to_keep"), checked.get("keep_every_steps"))
        return checked

    # -- checkpoints: the save path ------------------------------------------------------

    def begin_checkpoint(self, run: str, step: int, path: str) -> CheckpointRecord:
        """Arm ``(run, step)`` as ``pending`` before writing it; the record's ``save_id`` is
        what ``mark_committed``/``mark_failed`` need.

        A missing row is created; a ``failed``, ``deleted`` or ``pending`` one (a crashed
        earlier attempt) is re-armed under a new save id, which makes the older attempt's
        later ``mark_committed`` fail with ``StateConflictError``. Raises
        ``CheckpointExistsError`` for a ``committed`` step (never overwritten) and
        ``InvalidTransitionError`` for one gc is deleting; ``RunNotFoundError`` without the run.
        """
        run, step = validate.run_name(run), validate.step(step)
        path = validate.storage_url("path", path)
        with self._db.write(f"begin run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row, action, previous = transitions.begin(session, self.url, owner, step, path, _now())
            detail: dict[str, Any] = {"save_id": row.save_id, "path": path}
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
        bytes: int | None,
        file_count: int | None,
        manifest_checksum: str | None,
        metadata: dict[str, Any] | None = None,
    ) -> CheckpointRecord:
        """``pending -> committed`` after the commit marker is written, for this attempt only.

        Idempotent: if the row is already committed by the same attempt (a retry, or the
        marker probe promoted it), returns it unchanged. Raises ``StateConflictError`` when the
        row is no longer this attempt's pending row (re-armed by a newer attempt, failed by gc
        after the grace period), ``CheckpointNotFoundError`` without a row.
        """
        run, step = validate.run_name(run), validate.step(step)
        facts = _facts(bytes, file_count, manifest_checksum, metadata)
        with self._db.write(f"commit run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row, moved = transitions.commit(session, self.url, owner, step, save_id, facts, _now())
            if moved:
                detail = {
                    "save_id": save_id,
                    "bytes": bytes,
                    "file_count": file_count,
                    "manifest_checksum": manifest_checksum,
                }
                self._event(session, "committed", run, step, detail)
            return CheckpointRecord.of(row, run)

    def mark_failed(self, run: str, step: int, save_id: str, reason: str) -> CheckpointRecord:
        """``pending -> failed`` for this attempt: the save failed, or gc expired a stale row.

        Idempotent for the same attempt; ``StateConflictError`` if the row moved on
        (committed, or re-armed by a newer attempt). The directory left behind has no marker
        and is removed by gc as an orphan.
        """
        run, step = validate.run_name(run), validate.step(step)
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

    def pending_after(self, run: str, step: int | None) -> list[CheckpointRecord]:
        """Pending rows with a step above ``step`` (all pending rows if None), newest first.

        For the marker probe on resume: pass the latest committed step; a pending row whose
        marker exists on storage is promoted with ``mark_committed`` and its ``save_id``.
        """
        run = validate.run_name(run)
        if step is not None:
            step = validate.step(step)
        with self._db.read(f"list pending checkpoints of run {run!r}") as session:
            owner = runs.require(session, self.url, run)
            statement = queries.pending_after(owner.id, step)
            return [CheckpointRecord.of(row, run) for row in session.scalars(statement)]

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
        """One checkpoint row in any state (``CheckpointNotFoundError`` if none)."""
        run, step = validate.run_name(run), validate.step(step)
        with self._db.read(f"read run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row = transitions.load(session, owner.id, step)
            if row is None:
                raise CheckpointNotFoundError(self.url, run, step)
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
        bytes: int | None,
        file_count: int | None,
        manifest_checksum: str | None,
        metadata: dict[str, Any] | None = None,
        committed_at: datetime | None = None,
    ) -> tuple[CheckpointRecord | None, SyncOutcome]:
        """Record a checkpoint whose marker ``zephon sync`` found on storage. Idempotent.

        Inserts a missing row; promotes a pending, failed or deleted row to committed (storage
        is the source of truth); updates a committed row whose facts differ; leaves a row gc
        is deleting alone (``SyncOutcome.SKIPPED``). ``committed_at`` defaults to now.
        """
        run, step = validate.run_name(run), validate.step(step)
        facts = {
            "path": validate.storage_url("path", path),
            **_facts(bytes, file_count, manifest_checksum, metadata),
        }
        if metadata is None:
            del facts["meta"]  # unknown here: keep what the row has
        now = _now()
        with self._db.write(f"sync run {run!r} step {step}") as session:
            owner = runs.require(session, self.url, run)
            row, outcome = transitions.upsert_committed(
                session, owner, step, facts, committed_at or now, now
            )
            if outcome not in (SyncOutcome.UNCHANGED, SyncOutcome.SKIPPED):
                self._event(session, f"sync_{outcome.value}", run, step, {"path": path})
            return (CheckpointRecord.of(row, run) if row is not None else None), outcome

    def mark_missing(self, run: str, step: int, reason: str = MISSING_MARKER_REASON) -> bool:
        """``committed -> deleted`` for a checkpoint whose marker is gone from storage.

        For ``zephon sync``. Returns True if the row moved, False if it was not committed
        (pending rows may still be written; ``deleting`` ones belong to gc). The leftover
        payload, if any, has no marker and is removed by gc as an orphan.
        """
        run, step = validate.run_name(run), validate.step(step)
        with self._db.write(f"mark run {run!r} step {step} missing") as session:
            owner = runs.require(session, self.url, run, lock="update")
            row = transitions.mark_missing(session, owner, step, reason, _now())
            if row is not None:
                self._event(session, "marked_missing", run, step, {"reason": reason})
            return row is not None

    # -- retention and deletion ------------------------------------------------------------

    def retention_plan(
        self, run: str, *, grace: timedelta = DEFAULT_GRACE, now: datetime | None = None
    ) -> RetentionPlan:
        """``plan_retention`` over the run's committed and pending rows with its policy.

        Advisory: nothing is changed. Act on ``to_delete`` with ``claim_for_deletion`` (which
        re-checks) and on ``to_expire`` by probing the marker, then ``mark_committed`` or
        ``mark_failed`` with the decision's ``save_id``.
        """
        run = validate.run_name(run)
        with self._db.read(f"plan retention of run {run!r}") as session:
            owner = runs.require(session, self.url, run)
            live = [CheckpointState.COMMITTED, CheckpointState.PENDING]
            rows = session.execute(queries.retention_view(owner.id, live)).all()
            policy = (owner.num_to_keep, owner.keep_every_steps)
        return plan_retention(rows, *policy, now or _now(), grace)

    def claim_for_deletion(
        self,
        run: str,
        steps: Sequence[int],
        *,
        lease: timedelta = claims.DEFAULT_LEASE,
        now: datetime | None = None,
    ) -> list[CheckpointRecord]:
        """Move the given steps ``committed -> deleting`` for this caller; returns the rows won.

        Only rows that are still deletable under the run's current policy and rows (at the
        current moment, not the caller's plan) are claimed, and ``deleting`` rows whose lease
        is older than ``lease`` are re-claimed (a crashed gc). Rows locked or claimed by a
        concurrent gc, kept by the fresh plan, or not committed are silently left out: losing
        is normal, not an error. Each returned record's ``claimed_by`` is the token
        ``mark_deleted`` needs. Then delete from storage (marker first) and ``mark_deleted``.
        """
        run = validate.run_name(run)
        steps = [validate.step(s) for s in steps]
        if lease <= timedelta(0):
            raise InvalidValueError("lease", lease, "expected a duration > 0")
        token = f"{self._actor or default_actor()}/{transitions.new_save_id()[:12]}"
        now = now or _now()
        with self._db.write(f"claim checkpoints of run {run!r} for deletion") as session:
            owner = runs.require(session, self.url, run, lock="share")
            won = claims.claim(session, owner, steps, token, now, lease)
            for row, action in won:
                self._event(session, action, run, row.step, {"claim": token})
            return [CheckpointRecord.of(row, run) for row, _ in won]

    def mark_deleted(self, run: str, step: int, claim_token: str) -> bool:
        """``deleting -> deleted`` once storage no longer holds the checkpoint.

        True if this claim finished it; False if the claim was taken over after its lease
        expired (the other gc finishes it; deleting twice from storage is harmless).
        """
        run, step = validate.run_name(run), validate.step(step)
        with self._db.write(f"mark run {run!r} step {step} deleted") as session:
            owner = runs.require(session, self.url, run)
            row = claims.finish(session, owner, step, claim_token, _now())
            if row is not None:
                self._event(session, "deleted", run, step, {"claim": claim_token})
            return row is not None

    def expired_claims(
        self,
        *,
        run: str | None = None,
        lease: timedelta = claims.DEFAULT_LEASE,
        now: datetime | None = None,
    ) -> list[CheckpointRecord]:
        """``deleting`` rows whose lease is older than ``lease`` (a gc died mid-delete), of one
        run or all; pass their steps to ``claim_for_deletion`` to finish them."""
        cutoff = (now or _now()) - lease
        with self._db.read("list expired deletion claims") as session:
            run_id = None
            if run is not None:
                run_id = runs.require(session, self.url, validate.run_name(run)).id
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
    validate.optional_count("bytes", bytes)
    validate.optional_count("file_count", file_count)
    if manifest_checksum is not None and (
        not isinstance(manifest_checksum, str) or len(manifest_checksum) > 128
    ):
        raise InvalidValueError(
            "manifest_checksum", manifest_checksum, "expected a string of at most 128 characters"
        )
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidValueError("metadata", metadata, "expected a JSON object (dict) or None")
    return {
        "bytes": bytes,
        "file_count": file_count,
        "manifest_checksum": manifest_checksum,
        "meta": metadata,
    }


def _check_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    if config is not None and not isinstance(config, dict):
        raise InvalidValueError("config", config, "expected a JSON object (dict) or None")
    return config


def _run_detail(values: dict[str, Any]) -> dict[str, Any]:
    # The full config can be large; the event says that it changed, the run row holds it.
    return {k: ("<changed>" if k == "config" else v) for k, v in values.items()}
