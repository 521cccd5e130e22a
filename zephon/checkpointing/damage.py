"""What the manager does with a damaged checkpoint it meets while resuming (docs/manager.md,
``on_corrupt``): tell damage from other failures on every rank, quarantine the checkpoint and
say so in one log line, or stop with ``on_corrupt: fail``.

Apart from the loader because choosing a resume point is not the only way to meet one: the
attempt a job registers on its first save (``Job.current_attempt``) looks the latest up too.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from zephon.collectives import Collectives
from zephon.reconcile import quarantine
from zephon.storage import CheckpointNotFoundError, CorruptCheckpointError

if TYPE_CHECKING:
    from zephon.checkpointing.job import Job

__all__ = ["DAMAGE", "damage_on_any_rank", "report_passed_over", "set_aside"]

log = logging.getLogger("zephon")

#: what a load meets when a checkpoint is damaged: a checksum or size mismatch, a file gone
DAMAGE = (CorruptCheckpointError, CheckpointNotFoundError)


def damage_on_any_rank(coll: Collectives, problem: Exception | None) -> str | None:
    """Collective: what made the load fail, if on any rank it was damage (``DAMAGE``); None if
    every rank loaded or failed for another reason."""
    mine = None
    if isinstance(problem, DAMAGE):
        mine = f"{type(problem).__name__}: {problem}"
    reports = coll.all_gather(mine)
    return next((r for r in reports if r is not None), None)


def report_passed_over(job: Job, step: int, why: str) -> None:
    """Rank 0: ``find_latest`` passed over a damaged checkpoint (it quarantines it): say so in
    one line, or stop there with ``on_corrupt: fail`` (a ``CorruptCheckpointError``)."""
    url = job.store.run(job.run).checkpoint_url(step)
    if job.config.on_corrupt == "fail":
        raise CorruptCheckpointError(
            f"checkpoint {url} is damaged ({why.splitlines()[0][:300]}); it is not loaded and "
            "no older one is taken (on_corrupt: fail): inspect it, or set on_corrupt: "
            "fallback",
            url=url,
            run=job.run,
            step=step,
            problems=[why[:300]],
        )
    log.warning(
        "zephon: checkpoint %s is damaged (%s); it is quarantined and an older one is taken",
        url,
        why.splitlines()[0][:300],
    )


def set_aside(job: Job, step: int, why: str) -> None:
    """Rank 0: quarantine a checkpoint that failed to load and say so in one line."""
    url = job.store.run(job.run).checkpoint_url(step)
    try:
        manifest = job.store.run(job.run).read_manifest(step)
    except DAMAGE:
        manifest = None
    with contextlib.suppress(Exception):
        quarantine(job.catalog, job.location, step, why[:2000], manifest=manifest)
    log.warning(
        "zephon: checkpoint %s failed verification or vanished (%s); it is quarantined and "
        "the next complete checkpoint is loaded",
        url,
        why.splitlines()[0][:300],
    )
