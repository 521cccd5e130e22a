"""``Catalog``'s run methods: create, ensure, update, get and list runs."""

from __future__ import annotations

from typing import Any

from zephon.catalog import attempts, runs, validate
from zephon.catalog.models import RunKind, RunStatus
from zephon.catalog.records import RunRecord, RunSummary
from zephon.catalog.retention import validate_policy
from zephon.catalog.runs import UNSET, _Unset
from zephon.catalog.session_base import CatalogBase, utc_now

__all__ = ["OptionalInt", "RunMethods"]

OptionalInt = int | None | _Unset


class RunMethods(CatalogBase):
    """The runs role of ``Catalog`` (``catalog.runs`` does the row work)."""

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
        fields = _run_fields(status, total_steps, num_to_keep, keep_every_steps, config)
        values = _run_values({"storage_url": storage_url, "kind": kind, **fields})
        name = validate.run_name(name)
        with self._transaction(f"create run {name!r}", run=name) as transaction:
            run = runs.create(transaction.session, self.url, name, values, utc_now())
            transaction.event("run_created", detail=_run_detail(values))
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
        identity = _run_values({"storage_url": storage_url, "kind": kind})
        fields = _run_fields(status, total_steps, num_to_keep, keep_every_steps, config)
        changes = _given_changes(fields)
        defaults = {"status": RunStatus.ACTIVE.value}
        with self._transaction(f"ensure run {name!r}", run=name) as transaction:
            run, created, changed = runs.ensure(
                transaction.session, self.url, name, identity, changes, defaults, utc_now()
            )
            if created:
                transaction.event("run_created", detail=_run_detail(identity | changes))
            elif changed:
                transaction.event("run_updated", detail=_run_detail(changed))
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
        fields = _run_fields(status, total_steps, num_to_keep, keep_every_steps, config)
        changes = _given_changes(fields)
        if epoch is not None:
            epoch = validate.epoch(epoch)
        with self._run_transaction(f"update run {name!r}", name, lock="update") as transaction:
            if epoch is not None:
                attempts.check_current(transaction.session, self.url, transaction.run, epoch)
            changed = runs.apply_changes(transaction.run, changes, utc_now())
            if changed:
                transaction.event("run_updated", detail=_run_detail(changed))
            return RunRecord.of(transaction.run)

    def get_run(self, name: str) -> RunRecord:
        """The run (``RunNotFoundError`` if missing)."""
        name = validate.run_name(name)
        with self._run_transaction(f"read run {name!r}", name, write=False) as transaction:
            return RunRecord.of(transaction.run)

    def list_runs(self, *, status: str | None = None) -> list[RunSummary]:
        """Every run by name, with committed count/bytes, latest step (and its timings),
        pending count and last activity, computed in one query (``zephon runs``)."""
        if status is not None:
            status = validate.status(status)
        with self._transaction("list runs", write=False) as transaction:
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
                for row in runs.summaries(transaction.session, status)
            ]


def _run_fields(
    status: str | _Unset,
    total_steps: OptionalInt,
    num_to_keep: OptionalInt,
    keep_every_steps: OptionalInt,
    config: dict[str, Any] | None | _Unset,
) -> dict[str, Any]:
    """The changeable run fields by column name, as given (not checked yet)."""
    return {
        "status": status,
        "total_steps": total_steps,
        "num_to_keep": num_to_keep,
        "keep_every_steps": keep_every_steps,
        "config": config,
    }


def _given_changes(fields: dict[str, Any]) -> dict[str, Any]:
    """The ``_run_fields`` a caller gave (those not ``UNSET``), validated."""
    return _run_values({k: v for k, v in fields.items() if v is not UNSET})


def _run_values(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` checked field by field, and as a retention policy."""
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


def _run_detail(values: dict[str, Any]) -> dict[str, Any]:
    """A run's fields for an event. The full config can be large; the event says that it
    changed, the run row holds it."""
    return {k: ("<changed>" if k == "config" else v) for k, v in values.items()}
