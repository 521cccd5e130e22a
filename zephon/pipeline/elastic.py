"""Static check of the rules that make a topology change keep global batches identical.

With ``L = canonical_replicas`` lanes and ``G = dp_degree`` data-parallel groups:

1. ``L`` must be divisible by ``G`` (every group owns ``L / G`` lanes);
2. every group's microbatches per optimizer step must be a multiple of ``L / G`` (every owned
   lane gets equally many turns per step). Equivalently, with a global batch of ``N`` records,
   ``N`` is a multiple of ``L`` and each lane's share ``N / L`` a multiple of the microbatch size.

Check both for the old and the new topology before a resumed run starts training.
"""

from __future__ import annotations

from typing import Any

from zephon.errors import ConfigError

__all__ = ["check_elastic_config"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_elastic_config(
    canonical_replicas: int,
    dp_degree: int,
    microbatch_size: int,
    *,
    microbatches_per_step: int | None = None,
    global_batch_size: int | None = None,
) -> None:
    """Raise ``ConfigError`` naming the broken rule, or return ``None`` if the config is elastic.

    Give either ``microbatches_per_step`` (per data-parallel group, i.e. gradient accumulation
    steps) or ``global_batch_size`` (records per optimizer step over all groups), or both.
    """
    lanes = _positive("canonical_replicas", canonical_replicas)
    groups = _positive("dp_degree", dp_degree)
    size = _positive("microbatch_size", microbatch_size)
    if microbatches_per_step is None and global_batch_size is None:
        raise ConfigError(
            "check_elastic_config needs microbatches_per_step (per data-parallel group) or "
            "global_batch_size (records per optimizer step), got neither"
        )
    if lanes % groups:
        raise ConfigError(
            f"rule 1 (lanes divisible by groups): canonical_replicas={lanes} is not divisible "
            f"by dp_degree={groups}; choose a dp_degree that divides {lanes}"
        )
    per_group = lanes // groups
    if global_batch_size is not None:
        total = _positive("global_batch_size", global_batch_size)
        if total % (groups * size):
            raise ConfigError(
                f"global_batch_size={total} is not a whole number of microbatches: it must be a "
                f"multiple of dp_degree * microbatch_size = {groups * size}"
            )
        derived = total // (groups * size)
        if microbatches_per_step is not None and microbatches_per_step != derived:
            raise ConfigError(
                f"microbatches_per_step={microbatches_per_step} disagrees with "
                f"global_batch_size={total} / (dp_degree={groups} * microbatch_size={size}) "
                f"= {derived}"
            )
        microbatches_per_step = derived
    steps = _positive("microbatches_per_step", microbatches_per_step)
    if steps % per_group:
        raise ConfigError(
            f"rule 2 (whole rounds per step): each of the {groups} data-parallel groups owns "
            f"{per_group} lanes (canonical_replicas={lanes} / dp_degree={groups}), so its "
            f"microbatches per optimizer step must be a multiple of {per_group}, got {steps}; "
            f"equivalently the global batch ({groups * steps * size} records) must give every "
            f"lane a multiple of microbatch_size={size} records"
        )
