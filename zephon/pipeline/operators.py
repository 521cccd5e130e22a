"""Operator specifications: plain, immutable descriptions of what each builder method asked for.

The lane machinery (``lanes.py``) interprets them. Keeping them as data lets the pipeline
validate a chain before running it, describe it in the state dict (``signature``) and refuse a
restore into a different chain.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat, starmap
from operator import add, mul
from typing import Any

from zephon.errors import ConfigError

__all__ = [
    "PREFETCH_WORKERS",
    "BatchSpec",
    "MapOp",
    "Operator",
    "PackOp",
    "PrefetchSpec",
    "ShuffleOp",
    "jitter_order",
    "reorders",
    "signature",
]


@dataclass(frozen=True, slots=True)
class MapOp:
    """``fn`` applied to every record; ``None`` results are dropped when ``drop_none``."""

    fn: Callable[[Any], Any]
    drop_none: bool = True


@dataclass(frozen=True, slots=True)
class ShuffleOp:
    """A bounded-displacement shuffle inside each flush window (see ``jitter_order``)."""

    buffer_size: int
    seed: int = 0


@dataclass(frozen=True, slots=True)
class PackOp:
    """First-fit packing of token sequences into bins of at most ``max_length`` tokens."""

    max_length: int
    key: Callable[[Any], Sequence[Any]] | None = None
    max_open_bins: int = 64
    overflow: str = "truncate"


@dataclass(frozen=True, slots=True)
class BatchSpec:
    microbatch_size: int
    drop_last: bool = True


@dataclass(frozen=True, slots=True)
class PrefetchSpec:
    """Batches prepared ahead, and where maps run: ``parallelism`` worker processes (or
    threads, ``workers="threads"``) when it is above 1; see ``parallel.make_mapper``."""

    buffer_size: int
    parallelism: int = 1
    workers: str = "processes"


PREFETCH_WORKERS = ("processes", "threads")


Operator = MapOp | ShuffleOp | PackOp


def reorders(ops: Sequence[Operator]) -> bool:
    """True if the chain re-orders or regroups records, so it needs flush windows > 1 chunk."""
    return any(isinstance(op, (ShuffleOp, PackOp)) for op in ops)


def signature(ops: Sequence[Operator]) -> str:
    """A description of the chain's position-shaping parameters, stored in the state dict.

    Map functions are described by their drop_none flag only (a function's name says nothing
    about what it computes); batch size and prefetch are absent because a restore may change them.
    """
    parts = []
    for op in ops:
        if isinstance(op, MapOp):
            parts.append(f"map(drop_none={op.drop_none})")
        elif isinstance(op, ShuffleOp):
            parts.append(f"shuffle({op.buffer_size},seed={op.seed})")
        else:
            parts.append(f"pack({op.max_length},bins={op.max_open_bins},{op.overflow})")
    return "|".join(parts)


def jitter_order(n: int, buffer_size: int, seed: int) -> list[int]:
    """A permutation of ``range(n)`` that moves each position by less than ``buffer_size``.

    Each position ``i`` gets the key ``i + U[0, buffer_size)`` and positions are sorted by key:
    the same locality as a streaming shuffle buffer of that size, but computed for a whole
    window at once from the seed alone, without touching records. That is what makes skipping
    already-delivered records on restore cost a sort of integers instead of re-running maps.

    The draws are ``random.Random(seed).random()`` in order. With numpy installed the same
    floats come from its legacy Mersenne Twister (seeded by the same key words, the same 53-bit
    formula) and a stable argsort, about 4x faster on a flush window and the same permutation.
    """
    if buffer_size <= 1 or n <= 1:
        return list(range(n))
    numpy = _numpy()
    if numpy is None:
        return _jitter_python(n, buffer_size, seed)
    words = []  # CPython seeds Random(seed) with abs(seed) cut into 32-bit words, low first
    rest = abs(seed)
    while True:
        words.append(rest & 0xFFFFFFFF)
        rest >>= 32
        if not rest:
            break
    # a list, not an array: numpy would take a one-word array for a scalar seed
    draws = numpy.random.RandomState(words).random_sample(n)
    keys = numpy.arange(n, dtype=numpy.float64) + draws * buffer_size
    return numpy.argsort(keys, kind="stable").tolist()


def _jitter_python(n: int, buffer_size: int, seed: int) -> list[int]:
    draw = random.Random(seed).random
    # i + draw() * buffer_size for every i, draws in order, looped in C
    keys = list(map(add, range(n), map(mul, starmap(draw, repeat((), n)), repeat(buffer_size))))
    return sorted(range(n), key=keys.__getitem__)


_NUMPY: list[Any] = []


def _numpy() -> Any:
    """numpy if it is installed (an optional accelerator, never a dependency), else None."""
    if not _NUMPY:
        try:
            import numpy
        except ImportError:
            numpy = None
        _NUMPY.append(numpy)
    return _NUMPY[0]


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum``, else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
