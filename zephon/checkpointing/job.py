"""One job's checkpointing parts, shared by the saver, the loader and the manager: the checked
arguments, the store and run location, the manager's process group, the run session
(``zephon.session.RunSession``: the catalog on rank 0, the run's row, the job's attempt and its
retention) and the destination it chose (``zephon.destinations``: save_dir directly, or the
local tier first).

They live here, apart from what is done with them, so that saving (``saver``), resuming
(``loader``) and the public methods (``manager``) each read the same parts without reaching
into one another; ``Job`` opens them in order and closes what it opened if a step fails.
"""

from __future__ import annotations

from zephon.attempts import Attempt
from zephon.checkpointing.damage import report_passed_over
from zephon.collectives import Collectives
from zephon.config import MAX_STEP, CheckpointingConfig, ModelStageConfig
from zephon.errors import ConfigError
from zephon.locations import RunLocation, inference_run_name
from zephon.session import RunSession, SessionParts
from zephon.storage import CheckpointStore, InvalidNameError, validate_run

__all__ = ["ALREADY_COMPLETE", "Job"]

#: the kinds of job, and what ``load_latest`` logs when one already reached ``total_steps``
ALREADY_COMPLETE = {
    "train": "Training is already complete, nothing to do",
    "inference": "Inference is already complete, nothing to do",
}


def check_arguments(kind: str, run_name: str | None, total_steps: int | None) -> None:
    """Refuse, with a ``ConfigError`` naming the argument, what the manager cannot work with."""
    if kind not in ALREADY_COMPLETE:
        raise ConfigError(f"kind = {kind!r} is invalid: use 'train' or 'inference'")
    if kind == "train" and run_name is None:
        raise ConfigError("a training job needs run_name (run.name in the job config)")
    if run_name is not None:
        try:
            validate_run(run_name)
        except InvalidNameError as exc:
            raise ConfigError(f"run_name: {exc}") from None
    if kind == "inference" and run_name is not None:
        raise ConfigError(
            "an inference job has no run name (it saves to <save_dir>/save-<step>); pass "
            "catalog_name to name it in the catalog"
        )
    if total_steps is not None and (
        isinstance(total_steps, bool)
        or not isinstance(total_steps, int)
        or not 1 <= total_steps <= MAX_STEP
    ):
        raise ConfigError(
            f"total_steps = {total_steps!r} is invalid: use an integer from 1 to {MAX_STEP}"
        )


class Job(SessionParts):
    """The parts of one job's checkpointing (see the module docstring); construct on every
    rank at the same point of the program (the process group and the tier are collectives)."""

    def __init__(
        self,
        config: CheckpointingConfig,
        *,
        run_name: str | None,
        total_steps: int | None,
        kind: str,
        model_stage: ModelStageConfig | None,
        catalog_name: str | None,
        save_rng: bool,
    ) -> None:
        check_arguments(kind, run_name, total_steps)
        self.config = config
        self.kind = kind
        self.total_steps = total_steps
        self.model_stage = model_stage or ModelStageConfig()
        self.save_rng = save_rng
        self.store = CheckpointStore(
            config.save_dir, config.storage_options, role="save_dir", retry=config.retry
        )
        self.run = run_name
        self.name = (
            catalog_name or run_name or inference_run_name(self.store.location.canonical_url)
        )
        self.location = RunLocation(self.name, self.store, self.run)
        self.coll = Collectives()
        #: the run session: the catalog (rank 0), the run's row, the attempt, retention
        self.session = RunSession(
            self.location,
            catalog=config.catalog_url,
            retention=config.retention,
            kind=kind,
            total_steps=total_steps,
            catalog_outage_s=config.catalog_outage_s,
            is_main=self.coll.is_main,
            on_corrupt=lambda step, why: report_passed_over(self, step, why),
        )

        def open_catalog_on_main() -> None:
            _ = self.session.catalog  # opened with the run's row (owed through an outage)

        try:
            self.coll.from_main(open_catalog_on_main, "set up checkpointing")
            #: where saves go: save_dir directly, or the local tier (``local_dir``) first
            self.destination = self.session.open_destination(config.tier, self.coll)
        except BaseException:
            self.session.close_catalog()
            self.coll.destroy()
            raise

    # -- the session's parts, as the saver, the loader and the manager read them ---------------

    @property
    def reads_only_until_save(self) -> bool:
        """An inference job reads a run (often a training run's folder) before it writes
        anything of its own: its ``load_latest`` registers no attempt (docs/fencing.md, "Readers
        never write"); its first save does."""
        return self.kind == "inference"

    def current_attempt(self) -> Attempt:
        """Rank 0: this job's attempt. A job that saves without having registered one at
        ``load_latest`` registers it now: resuming from the step it loaded, or continuing the
        run's latest checkpoint (it never abandons history implicitly, and a save below that
        checkpoint is refused)."""
        return self.session.attempt_for_save()

    def retain(self) -> list[int]:
        """Rank 0: delete the checkpoints ``num_to_keep`` no longer keeps (``zephon.gc``'s
        retention, fenced by this job's attempt). Returns the deleted steps; [] elsewhere."""
        if not self.coll.is_main:
            return []
        self.current_attempt()
        return self.session.retain()

    def close(self) -> None:
        """Release the destination, the catalog, the process group and the store (in that
        order)."""
        try:
            self.session.close()
        finally:
            self.coll.destroy()
            self.store.close()
