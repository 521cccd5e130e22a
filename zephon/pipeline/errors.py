"""Errors raised by the data pipeline; each carries the data a caller needs to act on it.

All derive from :class:`zephon.errors.ZephonError`. Invalid builder or ``options()`` arguments
raise :class:`zephon.errors.ConfigError` (a ``ValueError``) naming the parameter, the value and
what is allowed; the classes here cover what goes wrong later: a state dict that cannot be
restored, a distributed checkpoint that cannot be assembled, a data source that cannot be read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zephon.errors import ZephonError

__all__ = [
    "AggregationError",
    "AggregationTimeoutError",
    "DataSourceError",
    "PipelineError",
    "PipelineStateError",
]


class PipelineError(ZephonError):
    """Root of the data pipeline's errors."""


class PipelineStateError(PipelineError, ValueError):
    """A state dict given to ``Pipeline.restore()`` is unusable.

    ``field`` is the dotted name of the offending entry (``"version"``, ``"lanes[3].batches"``,
    ``"canonical_replicas"``), ``value`` what the dict holds there and ``expected`` what this
    pipeline accepts.
    """

    def __init__(self, message: str, *, field: str, value: Any = None, expected: Any = None):
        super().__init__(message)
        self.field = field
        self.value = value
        self.expected = expected


class AggregationError(PipelineError):
    """The per-rank parts of a distributed checkpoint cannot be merged, written or exchanged."""

    def __init__(self, message: str, *, run_id: str | None = None, url: str | None = None):
        super().__init__(message)
        self.run_id = run_id
        self.url = url


class AggregationTimeoutError(AggregationError, TimeoutError):
    """A rank waited ``aggregate_timeout_s`` in ``checkpoint()`` and some ranks never arrived.

    Raised on every rank that waited (and, over torch.distributed, on a rank arriving after the
    others gave up). ``missing_ranks`` lists the ranks that did not arrive, sorted, so the
    operator knows which hosts to look at; ``url`` is the aggregate_dir or ``"torch://"``.
    """

    def __init__(
        self,
        message: str,
        *,
        missing_ranks: Sequence[int],
        timeout_s: float,
        run_id: str | None = None,
        url: str | None = None,
    ):
        super().__init__(message, run_id=run_id, url=url)
        self.missing_ranks = sorted(missing_ranks)
        self.timeout_s = timeout_s


class DataSourceError(PipelineError):
    """A dataset's shards cannot be found or parsed; ``url`` is credential-free."""

    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url
