"""``Catalog``'s retention and deletion: the advisory plan, and gc's claim protocol (claim,
delete from storage, ``mark_deleted``; release or take over claims). ``catalog.claims`` holds
the protocol, ``catalog.retention`` the plan."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from zephon.catalog import attempts, claims, runs, transitions, validate
from zephon.catalog.records import CheckpointRecord
from zephon.catalog.retention import DEFAULT_GRACE, RetentionPlan
from zephon.catalog.session_base import CatalogBase, call_time, utc_now

__all__ = ["DeletionMethods"]


class DeletionMethods(CatalogBase):
    """The retention and deletion role of ``Catalog``: ``retention_plan``,
    ``claim_for_deletion``, ``mark_deleted``, ``release_claims``, ``expired_claims``."""

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
        now = call_time(now)
        action = f"plan retention of run {run!r}"
        with self._run_transaction(action, run, write=False) as transaction:
            return claims.current_plan(
                transaction.session,
                transaction.run,
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
        token = f"{self._actor_name()}/{transitions.new_save_id()[:12]}"
        now = call_time(now)
        action = f"claim checkpoints of run {run!r} for deletion"
        with self._run_transaction(action, run, lock="share") as transaction:
            if epoch is not None:
                attempts.check_current(transaction.session, self.url, transaction.run, epoch)
            won = claims.claim(
                transaction.session,
                transaction.run,
                steps,
                token,
                now,
                lease,
                grace=grace,
                corrupt=bool(corrupt) or bool(requested),
                requested=bool(requested),
            )
            for row, event, was in won:
                transaction.event(event, row.step, {"claim": token, "from": was})
            return [CheckpointRecord.of(row, run) for row, _, _ in won]

    def mark_deleted(self, run: str, step: int, claim_token: str) -> bool:
        """``deleting -> deleted`` once storage no longer holds the checkpoint.

        True if this claim finished it; False if the claim was taken over after its lease
        expired (the other gc finishes it; deleting twice from storage is harmless).
        """
        run, step = validate.run_name(run), validate.step(step)
        claim_token = validate.text("claim_token", claim_token, maximum=255)
        action = f"mark run {run!r} step {step} deleted"
        with self._run_transaction(action, run) as transaction:
            row = claims.finish(transaction.session, transaction.run, step, claim_token, utc_now())
            if row is not None:
                transaction.event("deleted", step, {"claim": claim_token})
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
        action = f"release deletion claims of run {run!r}"
        with self._run_transaction(action, run) as transaction:
            rows = claims.release(transaction.session, transaction.run, tokens, utc_now())
            for row in rows:
                detail = {"claim": row.claimed_by, "reason": reason}
                transaction.event("released", row.step, detail)
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
        cutoff = call_time(now) - lease
        with self._transaction("list expired deletion claims", write=False) as transaction:
            run_id = None
            if run is not None:
                run_id = runs.require(transaction.session, self.url, run).id
            return [
                CheckpointRecord.of(row, name)
                for row, name in claims.expired_claims(transaction.session, run_id, cutoff)
            ]
