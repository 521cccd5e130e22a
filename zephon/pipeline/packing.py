"""Greedy first-fit packing of token sequences into fixed-capacity bins."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zephon.pipeline.errors import PipelineError
from zephon.pipeline.operators import PackOp

__all__ = ["pack_first_fit"]


def _tokens_of(payload: Any, op: PackOp) -> Sequence[Any]:
    if op.key is not None:
        return op.key(payload)
    if isinstance(payload, dict) and "tokens" in payload:
        return payload["tokens"]
    if isinstance(payload, (list, tuple)):
        return payload
    raise PipelineError(
        f"pack_sequences needs token lists: got a {type(payload).__name__} record; return a list "
        "(or a dict with 'tokens') from map_transform, or pass key=<payload -> tokens>"
    )


def pack_first_fit(
    payloads: Sequence[Any], provenance: Sequence[tuple[int, ...]], op: PackOp
) -> tuple[list[dict], list[tuple]]:
    """Pack ``payloads`` in order; returns the bins' payloads and their members' provenance.

    Each sequence goes into the first open bin with room for it, else a new bin. At most
    ``op.max_open_bins`` bins stay open: opening one more closes (emits) the oldest. Bins left
    open at the end are emitted in the order they were opened. A bin's payload is
    ``{"tokens": [...], "segment_lengths": [...]}``. Longer-than-``max_length`` sequences are
    cut to ``max_length`` (``overflow="truncate"``) or refused (``"error"``).
    """
    capacity = op.max_length
    open_bins: list[list] = []  # [free, tokens, lengths, provenance]
    out_payloads: list[dict] = []
    out_prov: list[tuple] = []

    def emit(b: list) -> None:
        out_payloads.append({"tokens": b[1], "segment_lengths": b[2]})
        out_prov.append(tuple(b[3]))

    for payload, prov in zip(payloads, provenance, strict=True):
        tokens = list(_tokens_of(payload, op))
        if len(tokens) > capacity:
            if op.overflow == "error":
                raise PipelineError(
                    f"pack_sequences: a sequence of {len(tokens)} tokens exceeds max_length="
                    f"{capacity}; raise max_length or use overflow='truncate'"
                )
            tokens = tokens[:capacity]
        size = len(tokens)
        for b in open_bins:
            if b[0] >= size:
                break
        else:
            b = [capacity, [], [], []]
            open_bins.append(b)
            if len(open_bins) > op.max_open_bins:
                emit(open_bins.pop(0))
        b[0] -= size
        b[1].extend(tokens)
        b[2].append(size)
        b[3].extend(prov)
    for b in open_bins:
        emit(b)
    return out_payloads, out_prov
