"""Retention and garbage collection: apply each run's policy, finish interrupted deletes,
settle pending rows whose writer died, delete abandoned (stale) checkpoints after the grace,
corrupt ones on request, and leftovers of saves that never committed.

Safe to run in several processes at once and beside saving jobs: deletions go through the
catalog's claims (a row is deleted by exactly one claimant, and a job's own retention is fenced
by its epoch in the claim's transaction), pending rows are settled with guarded transitions
only after ``pending_grace`` (never ``grace``: ``--grace 0`` beside a live job is safe), and a
crash at any point is finished by the next run. Every step is judged by ``zephon.reconcile``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zephon.attempts import UNREAD, fenced, mirror_lineage
from zephon.catalog import (
    DEFAULT_GRACE,
    DEFAULT_LEASE,
    AttemptRecord,
    Catalog,
    CatalogError,
    CatalogUnavailableError,
    CheckpointRecord,
    ResumePoint,
    RetentionPlan,
    StateConflictError,
    plan_retention,
)
from zephon.errors import StaleAttemptError
from zephon.holders import held_claims, still_held
from zephon.locations import RunLocation, run_location
from zephon.outage import DebtBeingPaid, guard
from zephon.reconcile import Verdict, examine, quarantine, record_history, repair
from zephon.storage import CheckpointStore, Fence, Lineage, RetryPolicy, StorageError
from zephon.sync import SyncReport, reconcile_run

__all__ = [
    "DEFAULT_EVENTS_AGE",
    "GcPolicy",
    "GcReport",
    "collect_garbage",
    "apply_retention",
    "delete_requested",
    "gc_run",
    "retain_without_catalog",
    "retention_drops",
]

#: how long the audit log keeps an event before a full gc pass prunes it
DEFAULT_EVENTS_AGE = dt.timedelta(days=90)

#: rows whose files an orphan sweep never touches: a save in progress, the history, gc's own
_LIVE = frozenset({"pending", "committed", "deleting"})


@dataclass
class GcReport:
    """What one gc pass did (or, with ``dry_run``, would do)."""

    dry_run: bool
    deleted: list[dict[str, Any]] = field(default_factory=list)
    settled: list[dict[str, Any]] = field(default_factory=list)
    orphans: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: deletions left undone: ``{"run", "step", "claimed_by", "lease_expires"}``; a claim this
    #: pass released after a failed delete has ``lease_expires`` None (the next gc takes it at
    #: once), one held by a process this host cannot judge the time its lease ends
    remaining: list[dict[str, Any]] = field(default_factory=list)
    #: audit events older than ``GcPolicy.events_age`` deleted (None: not pruned this pass)
    events_pruned: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "deleted": self.deleted,
            "settled": self.settled,
            "orphans": self.orphans,
            "problems": self.problems,
            "remaining": self.remaining,
            "events_pruned": self.events_pruned,
        }

    def remaining_line(self) -> str | None:
        """One line saying which deletions remain and when a gc finishes them; None if none."""
        groups: dict[tuple[str, str | None, str | None], list[int]] = {}
        for item in self.remaining:
            key = (item["run"], item["claimed_by"], item["lease_expires"])
            groups.setdefault(key, []).append(item["step"])
        if not groups:
            return None
        parts = []
        for (run, holder, expires), steps in sorted(groups.items(), key=str):
            if expires is None:
                when = "the delete failed, the claim is released: the next gc finishes them at once"
            else:
                when = (
                    f"claimed by {holder}, a process this host cannot judge, lease expires "
                    f"{expires}: the first gc after that finishes them"
                )
            parts.append(f"run {run} {_steps_text(steps)} ({when})")
        return f"remaining: {len(self.remaining)} deletion(s) not finished: " + "; ".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class GcPolicy:
    """How long things live: ``grace`` for leftovers and abandoned checkpoints,
    ``pending_grace`` for a save to commit, ``lease`` for a deletion claim; ``corrupt``
    also deletes checkpoints that failed verification (kept for inspection otherwise);
    ``events_age``: audit events older than this are pruned by a full gc pass (None keeps
    them all)."""

    grace: dt.timedelta = DEFAULT_GRACE
    pending_grace: dt.timedelta = DEFAULT_GRACE
    lease: dt.timedelta = DEFAULT_LEASE
    corrupt: bool = False
    events_age: dt.timedelta | None = DEFAULT_EVENTS_AGE


def collect_garbage(
    catalog: Catalog,
    *,
    runs: Iterable[str] | None = None,
    policy: GcPolicy = GcPolicy(),
    dry_run: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] = lambda _: None,
    retry: RetryPolicy | None = None,
) -> GcReport:
    """One gc pass over the given runs (default: every run in the catalog).

    A problem with one run is recorded in the report and the other runs still processed.
    """
    report = GcReport(dry_run=dry_run)
    if runs is None:
        records = [summary.run for summary in catalog.list_runs()]
    else:
        records = [catalog.get_run(name) for name in runs]
    stores: dict[str, CheckpointStore] = {}
    for record in records:
        progress(record.name)
        try:
            location = run_location(record, storage_options, retry)
            gc_run(catalog, location, policy=policy, dry_run=dry_run, report=report)
            stores.setdefault(location.store.location.canonical_url, location.store)
        except (CatalogError, StorageError) as exc:
            report.problems.append(f"run {record.name}: {exc}")
    if not dry_run:
        for url, store in stores.items():  # the chunks every run of a save_dir shares
            try:
                store.sweep_chunks(
                    older_than_s=policy.grace.total_seconds(),
                    live=lambda: _live_saves(catalog, [s.run.name for s in catalog.list_runs()]),
                )
            except (CatalogError, StorageError) as exc:
                report.problems.append(f"chunks of {url}: {exc}")
    if runs is None and policy.events_age is not None and not dry_run:
        try:
            report.events_pruned = catalog.prune_events(older_than=policy.events_age)
        except CatalogError as exc:
            report.problems.append(f"pruning events: {exc}")
    return report


def gc_run(
    catalog: Catalog,
    location: RunLocation,
    *,
    policy: GcPolicy = GcPolicy(),
    dry_run: bool = False,
    orphans: bool = True,
    report: GcReport | None = None,
    epoch: int | None = None,
    lineage: Lineage | None = None,
) -> GcReport:
    """Apply one run's retention: settle expired pending rows, delete what the policy no
    longer keeps (stale, and corrupt with ``policy.corrupt``; and what a crashed gc left),
    then remove leftovers.

    The checkpoint manager calls this on the main process after each save with its attempt's
    ``epoch``: its claims are then refused (``zephon.StaleAttemptError``) once a newer attempt
    registered, so a stale attempt's retention never runs. It also passes its attempt's own
    ``lineage`` (``fence.lineage``: what its commit's fence re-check just confirmed), which
    saves reading the run's lineage from storage (one listing and one GET) after every save;
    by default it is read.
    """
    report = report or GcReport(dry_run=dry_run)
    name, store, storage_run = location.name, location.store, location.storage_run

    def make_plan() -> RetentionPlan:
        return catalog.retention_plan(
            name, grace=policy.grace, pending_grace=policy.pending_grace, corrupt=policy.corrupt
        )

    plan: RetentionPlan | None = None
    if epoch is not None:
        # The fence, also when there is nothing to claim. A saving job's pass (no orphans)
        # checks it on the plan's own read, which carries the current attempt; the plan is
        # made again only if the lineage mirror below changed the run's attempts.
        if orphans or dry_run:
            _check_current(epoch, name, catalog.current_attempt(name))
        else:
            plan = make_plan()
            _check_current(epoch, name, plan.current)
    lineage = lineage if lineage is not None else store.run(storage_run).lineage()
    if not dry_run and orphans:
        # Markers the catalog never heard of get rows (an abandoned one a stale row, deleted
        # below once past the grace); rows whose marker is gone are marked deleted.
        reconcile_run(catalog, location, SyncReport(location.store.url), pending=False)
    elif not dry_run:
        current = plan.current if plan is not None else UNREAD
        if mirror_lineage(catalog, location, lineage, current=current):
            plan = None  # attempts registered: their abandoned rows change the plan
    if plan is None:
        plan = make_plan()
    for decision in plan.to_expire:
        _settle_expired(catalog, location, lineage, decision, dry_run, report)

    held = held_claims(catalog, name, policy.lease, dry_run, held=plan.held)
    candidates = sorted(set(plan.to_delete) | held.takeable)
    if dry_run:
        for step in candidates:
            report.deleted.append({"run": name, "step": step, "files": None})
    elif candidates:
        with fenced():
            claimed = catalog.claim_for_deletion(
                name,
                candidates,
                epoch=epoch,
                corrupt=policy.corrupt,
                grace=policy.grace,
                lease=policy.lease,
            )
        _delete_claimed(catalog, location, claimed, report)
        if not dry_run and claimed:
            finished = [row.save_id for row in claimed]
            sweep_chunks_of(
                location,
                lineage,
                policy.grace,
                finished,
                store_too=not orphans,
                live=lambda: _live_saves(catalog, [name]),
            )
    if held.unknown:
        report.remaining.extend(still_held(catalog, name, held.unknown, policy.lease))

    if orphans:
        _remove_leftovers(catalog, location, policy, dry_run, report)
    return report


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(str(step) for step in sorted(steps)[:8])
    more = f" and {len(steps) - 8} more" if len(steps) > 8 else ""
    return f"step{'s' if len(steps) > 1 else ''} {shown}{more}"


def _delete_claimed(
    catalog: Catalog, location: RunLocation, claimed: list[CheckpointRecord], report: GcReport
) -> None:
    """Delete the claimed checkpoints (one batched delete: every marker first, then the
    payloads) and mark them deleted.

    On any failure the claims not yet marked are released before the error goes on, so that the
    next gc finishes them at once rather than after the lease; they are reported remaining."""
    name = location.name
    try:
        removed = location.runstore.delete_many([row.step for row in claimed])
        for row in claimed:
            catalog.mark_deleted(name, row.step, row.claimed_by)
            report.deleted.append({"run": name, "step": row.step, "files": removed[row.step]})
    except BaseException as failure:
        tokens = sorted({row.claimed_by for row in claimed if row.claimed_by is not None})
        reason = f"the delete failed: {type(failure).__name__}: {failure}"[:500]
        try:
            released = catalog.release_claims(name, tokens, reason)
        except CatalogError as also:
            failure.add_note(
                f"its claims on run {name!r} could not be released ({also}); the next gc on "
                "this host takes them over once this process has exited, any other after the "
                "lease"
            )
            released = []
        report.remaining.extend(
            {"run": name, "step": step, "claimed_by": None, "lease_expires": None}
            for step in released
        )
        raise


def _check_current(epoch: int, name: str, current: AttemptRecord | None) -> None:
    """Raise ``StaleAttemptError`` unless ``current``, the run's current attempt as just
    read, is ``epoch``'s."""
    if current is not None and current.epoch != epoch:
        raise StaleAttemptError(
            f"run {name!r}: attempt epoch {epoch} is no longer current: {current.describe()} "
            "took over; this process is a stale attempt: its retention does not run",
            current=current,
        )


def _settle_expired(catalog, location: RunLocation, lineage, decision, dry_run, report) -> None:
    """A pending row older than ``pending_grace``: its writer most likely died. A complete
    marker of its save is history (a crash after the marker) and is promoted; no marker means
    the save never finished and the row fails; anything else follows the one rule."""
    row = catalog.get_checkpoint(location.name, decision.step)
    if row.state != "pending" or row.save_id != decision.save_id:
        return  # moved on since the plan
    seen = examine(location, lineage, decision.step, row)
    verdict = seen.judgement.verdict
    outcome = {
        Verdict.HISTORY: "committed",
        Verdict.REPAIR: "committed",
        Verdict.CORRUPT: "corrupt",
    }.get(verdict, "failed")
    report.settled.append({"run": location.name, "step": decision.step, "to": outcome})
    if dry_run:
        return
    try:
        if verdict is Verdict.HISTORY and seen.manifest is not None:
            record_history(catalog, location, seen.manifest)
        elif verdict is Verdict.REPAIR:
            repair(catalog, location, seen)
        elif verdict is Verdict.CORRUPT and seen.manifest is not None:
            quarantine(
                catalog, location, decision.step, seen.judgement.reason, manifest=seen.manifest
            )
        else:
            catalog.mark_failed(
                location.name,
                decision.step,
                decision.save_id,
                f"no usable commit marker after the pending grace ({seen.judgement.reason}): "
                "the writer did not finish",
            )
    except StateConflictError:
        report.settled.pop()  # the writer or another gc moved it first


def _remove_leftovers(catalog, location: RunLocation, policy: GcPolicy, dry_run, report) -> None:
    """Payload directories of saves that never committed (or were superseded) and loose files
    of uncommitted steps, older than the grace; with ``policy.corrupt`` also condemned saves.

    Storage is listed before the catalog is read: a save writes its row before its first file,
    so a directory the listing saw has a row this read sees, and a live save is never taken
    for a leftover however small the grace."""
    store, storage_run, name = location.store, location.storage_run, location.name
    if not dry_run:
        sweep_chunks_of(location, None, policy.grace, live=lambda: _live_saves(catalog, [name]))
    leftovers = store.orphans(policy.grace.total_seconds(), runs=[storage_run])
    condemned = store.run(storage_run).condemned() if policy.corrupt else []
    rows = {row.step: row for row in catalog.list_checkpoints(name)}
    for orphan in leftovers:
        row = rows.get(orphan.step)
        if row is not None and row.state in _LIVE:
            if orphan.save_id is None or orphan.save_id == row.save_id:
                continue  # the row's own save: in progress, history, or gc's own delete
            if row.state == "pending" and orphan.save_id is None:
                continue
        report.orphans.append({"run": name, "step": orphan.step, "url": orphan.url})
        if not dry_run:
            store.remove_orphan(orphan)
            catalog.record_event(
                "orphan_removed", run=name, step=orphan.step, detail={"url": orphan.url}
            )
    for step, save_id in condemned:
        row = rows.get(step)
        if row is not None and row.save_id == save_id and row.state != "deleted":
            continue  # its row is claimed and deleted by the retention pass
        url = location.checkpoint_url(step)
        report.deleted.append({"run": name, "step": step, "files": None, "condemned": save_id})
        if not dry_run:
            store.run(storage_run).remove_condemned(step, save_id)
            catalog.record_event(
                "condemned_removed", run=name, step=step, detail={"url": url, "save": save_id}
            )


@dataclass(frozen=True, slots=True)
class _StorageRow:
    """A complete checkpoint seen on storage, in the shape retention planning reads."""

    step: int
    save_id: str
    state: str = "committed"
    pinned: bool = False
    created_at: dt.datetime = dt.datetime.fromtimestamp(0, dt.UTC)
    updated_at: dt.datetime = dt.datetime.fromtimestamp(0, dt.UTC)


def apply_retention(
    location: RunLocation,
    catalog: Catalog | None,
    fence: Fence,
    num_to_keep: int | None,
    keep_every_steps: int | None = None,
) -> list[int]:
    """The retention a saving job applies after each commit, the one choice every save path
    shares (the manager, the drop-in DCP writer, the framework integrations): with a catalog,
    the run's policy as the catalog holds it (``num_to_keep``, milestones, pins) through fenced
    claims; without one, ``num_to_keep`` and ``keep_every_steps`` over storage. Returns the
    deleted steps.

    With the catalog unreachable nothing is deleted (its claims are what make a deletion safe):
    the retention is owed to it (``zephon.outage``) and runs once it answers, after the run's
    rows are brought in line with storage."""
    if catalog is not None:
        outage = guard(catalog)

        def retain() -> list[int]:
            # The attempt's own lineage: its commit re-checked the fence just before the
            # marker, and the claims below are fenced by its epoch in their transaction.
            report = gc_run(
                catalog, location, orphans=False, epoch=fence.epoch, lineage=fence.lineage
            )
            return [deleted["step"] for deleted in report.deleted]

        def pay_then_retain() -> list[int]:
            outage.pay(location)  # the rows first: retention judges by them
            return retain()

        try:
            return outage.call(pay_then_retain)
        except (CatalogUnavailableError, DebtBeingPaid):
            pass
        outage.defer(location, "retention", retain)
        return []
    if num_to_keep is None and keep_every_steps is None:
        return []
    return retain_without_catalog(
        location.store, location.storage_run, fence, num_to_keep, keep_every_steps
    )


def delete_requested(
    location: RunLocation, catalog: Catalog | None, fence: Fence, steps: Iterable[int]
) -> list[int]:
    """Delete the checkpoints a framework's own retention no longer wants (Lightning's
    ``save_top_k``), fenced by the attempt: with a catalog through the same claim, marker-first
    delete and ``mark_deleted`` as gc (pinned checkpoints and the attempt's resume point are
    never claimed); without one, after the storage fence check. A stale attempt deletes
    nothing (``zephon.StaleAttemptError``). Returns the deleted steps."""
    steps = sorted(set(steps))
    if not steps:
        return []
    name, store, storage_run = location.name, location.store, location.storage_run
    with fenced():
        if catalog is None:
            store.run(storage_run).check_fence(fence)
            store.run(storage_run).delete_many(steps)
            return steps
        claimed = catalog.claim_for_deletion(name, steps, epoch=fence.epoch, requested=True)
    _delete_claimed(catalog, location, claimed, GcReport(dry_run=False))
    return [row.step for row in claimed]


def retain_without_catalog(
    store: CheckpointStore,
    storage_run: str | None,
    fence: Fence,
    num_to_keep: int | None,
    keep_every_steps: int | None = None,
) -> list[int]:
    """Retention for a job running without a catalog: keep the ``num_to_keep`` newest
    checkpoints of the current history (and milestones, and the attempt's resume point until
    it committed one of its own), delete the others. Fenced: a stale attempt's retention is
    refused before it plans and again right before it deletes. Returns the deleted steps.
    Pins live in the catalog, so none apply here."""
    with fenced():
        store.run(storage_run).check_fence(fence)
        manifests = store.run(storage_run).complete(lineage=fence.lineage)
        resumed = fence.record.resumed_from
        if any(m.epoch == fence.epoch and m.step > (resumed or 0) for m in manifests):
            resumed = None  # the attempt stands on a checkpoint of its own now
        plan = plan_retention(
            [_StorageRow(m.step, m.save_id) for m in manifests],
            num_to_keep,
            keep_every_steps,
            dt.datetime.now(dt.UTC),
            DEFAULT_GRACE,
            resume_point=ResumePoint(resumed, fence.epoch) if resumed is not None else None,
        )
        if plan.to_delete:
            store.run(storage_run).check_fence(fence)
            store.run(storage_run).delete_many(plan.to_delete)
            finished = [m.save_id for m in manifests if m.step in set(plan.to_delete)]
            sweep_chunks_of(
                RunLocation(storage_run or "inference", store, storage_run),
                fence.lineage,
                DEFAULT_GRACE,
                finished,
                store_too=True,
            )
    return plan.to_delete


def sweep_chunks_of(
    location: RunLocation,
    lineage: Lineage | None,
    grace: dt.timedelta,
    finished: Iterable[str | None] = (),
    *,
    store_too: bool = False,
    live: Callable[[], Iterable[str]] | None = None,
) -> None:
    """Remove the run's chunk instances that no checkpoint references any more (deduplicated
    saves; docs/dedup.md): after retention deleted checkpoints, whose saves (``finished``)
    are over, and in every full gc pass. ``store_too``: the store's shared chunks as well
    (``dedup_scope: save_dir``), which reads every run's markers; a full gc pass sweeps those
    once for all its runs instead. ``live``: the saves a catalog knows to be in progress or
    kept (its live rows), whose chunks are spared whatever the grace. A no-op listing where
    nothing was deduplicated."""
    done = [save_id for save_id in finished if save_id]
    spared = (lambda: set(live())) if live is not None else None
    location.runstore.sweep_chunks(
        older_than_s=grace.total_seconds(), finished=done, lineage=lineage, live=spared
    )
    if store_too and location.storage_run is not None:
        location.store.sweep_chunks(older_than_s=grace.total_seconds(), finished=done, live=spared)


def _live_saves(catalog: Catalog, runs: Iterable[str]) -> set[str]:
    """The save ids of the runs' live rows (pending, committed, deleting): a save's row is
    armed before its first file or chunk, so a chunk a listing saw belongs to a save whose row
    this read sees (gc's leftovers follow the same order)."""
    return {
        row.save_id for run in runs for row in catalog.list_checkpoints(run, states=sorted(_LIVE))
    }


def retention_drops(
    step: int, newer: Iterable[int], num_to_keep: int | None, keep_every_steps: int | None
) -> bool:
    """Whether retention would delete ``step`` once it and the ``newer`` steps are committed:
    the question a failed upload asks before it is retried (docs/tiers.md, "Retries"); a step
    retention would drop anyway is superseded, not uploaded. Pins and resume points, which
    only committed rows carry, do not apply."""
    if num_to_keep is None and keep_every_steps is None:
        return False
    steps = {step, *(s for s in newer if s > step)}
    plan = plan_retention(
        [_StorageRow(s, "") for s in steps],
        num_to_keep,
        keep_every_steps,
        dt.datetime.now(dt.UTC),
        DEFAULT_GRACE,
    )
    return step in plan.to_delete
