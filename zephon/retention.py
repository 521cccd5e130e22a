"""A job's retention options, checked in one place with one message for every entry point
(the manager's config, ``zephon.dcp.Writer``, the framework integrations), and the other
argument every saving entry point shares, ``resume_step``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zephon.errors import ConfigError
from zephon.storage import MAX_STEP, redact

__all__ = ["MAX_KEEP", "Retention", "RetentionOptions", "check_resume_step", "option_name"]

#: the largest num_to_keep a catalog column holds (INTEGER)
MAX_KEEP = 2**31 - 1

#: each retention option: its largest value (the catalog column's range)
_RETENTION_LIMITS = {"num_to_keep": MAX_KEEP, "keep_every_steps": MAX_STEP}
#: what None means for each retention option
_NONE_MEANS = {"num_to_keep": "to keep every checkpoint", "keep_every_steps": "for no milestones"}


def option_name(owner: str, key: str) -> str:
    """How a message names an option: ``trainer.checkpointing.num_to_keep`` for a config key
    (``owner`` ends with a dot), ``Writer num_to_keep`` for an argument."""
    return f"{owner}{key}" if owner.endswith(".") else f"{owner} {key}".strip()


@dataclass(frozen=True, slots=True)
class Retention:
    """What a job keeps of its run, frozen for the job's life.

    ``num_to_keep``: the newest committed checkpoints kept (None: every one);
    ``keep_every_steps``: also keep each checkpoint whose step is a multiple of it
    (milestones; None: none). Checkpoints pinned in the catalog (``zephon pin``) are always
    kept. The job's values are authoritative: with a catalog they become the run's policy,
    so a job keeps the same checkpoints with a catalog as without one.
    """

    num_to_keep: int | None = None
    keep_every_steps: int | None = None

    @classmethod
    def checked(
        cls,
        owner: str,
        num_to_keep: Any = None,
        keep_every_steps: Any = None,
    ) -> Retention:
        """The retention of these options, or a one-line ``ConfigError`` naming the option
        (``owner``: who takes it, e.g. ``"Writer"``, or a config prefix ending in a dot)."""
        given = {"num_to_keep": num_to_keep, "keep_every_steps": keep_every_steps}
        for key, value in given.items():
            most = _RETENTION_LIMITS[key]
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most
            ):
                raise ConfigError(
                    f"{option_name(owner, key)} = {redact(repr(value))} is invalid: use an "
                    f"integer from 1 to {most}, or null (Python: None) {_NONE_MEANS[key]}"
                )
        return cls(num_to_keep, keep_every_steps)


def check_resume_step(owner: str, resume_step: Any) -> int | None:
    """``resume_step`` as an entry point takes it: the step the job resumed from (0: it
    starts over), or None; a one-line ``ConfigError`` otherwise."""
    if resume_step is None:
        return None
    if (
        isinstance(resume_step, bool)
        or not isinstance(resume_step, int)
        or not (0 <= resume_step <= MAX_STEP)
    ):
        raise ConfigError(
            f"{option_name(owner, 'resume_step')} = {redact(repr(resume_step))} is invalid: use "
            f"an integer from 0 to {MAX_STEP} (the step this job resumes from), or None"
        )
    return resume_step


class RetentionOptions:
    """For an entry point that holds its ``retention``: ``num_to_keep`` and
    ``keep_every_steps`` readable as its own attributes, as users passed them."""

    retention: Retention

    @property
    def num_to_keep(self) -> int | None:
        return self.retention.num_to_keep

    @property
    def keep_every_steps(self) -> int | None:
        return self.retention.keep_every_steps
