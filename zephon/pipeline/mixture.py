"""Mixture weights: ``MixtureSpec`` and the one place a work source's ``mixture=`` is checked.

A mixture says which share of *records* each dataset contributes. It is given to
``StaticMixtureWorkSource(mixture=...)`` as a ``MixtureSpec``, a ``{name: weight}`` mapping or a
sequence parallel to the datasets; all three resolve here to the same list of weights, so they
plan the same curriculum and give the same ``work_source`` digest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from zephon.errors import ConfigError

__all__ = ["MixtureSpec", "resolve_weights"]


def _check_weight(name: str, weight: Any) -> float:
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
        or weight <= 0
    ):
        raise ConfigError(
            f"mixture weight for dataset {name!r} must be a finite number > 0, got {weight!r}"
        )
    return float(weight)


@dataclass(frozen=True)
class MixtureSpec:
    """Relative weights of the datasets of a mixture, by dataset name.

    ``MixtureSpec({"code": 1, "web": 3})`` gives ``web`` three records for each of ``code``;
    weights are relative (``{"code": 0.25, "web": 0.75}`` is the same mix). Pass it as
    ``StaticMixtureWorkSource([code, web], MixtureSpec(...))``: the names must be exactly the
    datasets' names. Validated when built, so a bad weight fails where it is written.
    """

    weights: Mapping[str, float]

    def __post_init__(self) -> None:
        weights = self.weights
        if not isinstance(weights, Mapping):
            raise ConfigError(
                "MixtureSpec weights must be a mapping {dataset name: weight}, e.g. "
                f"MixtureSpec({{'web': 3, 'code': 1}}), got {type(weights).__name__}"
            )
        if not weights:
            raise ConfigError("MixtureSpec needs at least one {dataset name: weight}, got none")
        checked: dict[str, float] = {}
        for name, weight in weights.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(
                    f"MixtureSpec keys must be dataset names (non-empty strings), got {name!r}"
                )
            _check_weight(name, weight)
            checked[name] = weight
        # A read-only copy: a spec cannot change under a work source that already planned.
        object.__setattr__(self, "weights", MappingProxyType(checked))

    @property
    def normalized(self) -> dict[str, float]:
        """The weights scaled to sum to 1, in the order given."""
        total = sum(self.weights.values())
        return {name: w / total for name, w in self.weights.items()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MixtureSpec):
            return NotImplemented
        return dict(self.weights) == dict(other.weights)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.weights.items())))

    def __repr__(self) -> str:
        return f"MixtureSpec({dict(self.weights)!r})"


def resolve_weights(
    mixture: MixtureSpec | Mapping[str, float] | Iterable[float], names: list[str]
) -> list[float]:
    """The weights of ``mixture`` in the order of ``names`` (the work source's datasets).

    Weights are kept as given (not normalised): a spec, a dict and a list of the same numbers
    resolve to the same list, hence the same plan and digest.
    """
    if isinstance(mixture, MixtureSpec):
        mixture = mixture.weights
    if isinstance(mixture, Mapping):
        if set(mixture) != set(names):
            raise ConfigError(
                f"mixture keys must be exactly the dataset names {sorted(names)}, got "
                f"{sorted(mixture, key=str)}"
            )
        weights = [mixture[n] for n in names]
    else:
        try:
            if isinstance(mixture, (str, bytes)):
                raise TypeError
            weights = list(mixture)
        except TypeError:
            raise ConfigError(
                "mixture must be a MixtureSpec, a {dataset name: weight} dict, a list of "
                f"weights parallel to datasets, or None, got {type(mixture).__name__}"
            ) from None
        if len(weights) != len(names):
            raise ConfigError(
                f"mixture must have one weight per dataset ({len(names)}), got {len(weights)}"
            )
    return [_check_weight(name, w) for name, w in zip(names, weights, strict=True)]
