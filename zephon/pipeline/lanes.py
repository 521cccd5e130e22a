"""Lanes: each lane turns its own chunks into a deterministic stream of records.

A lane's chunks are grouped into *flush windows* of ``k`` consecutive chunks (``k`` is
``flush_every_k_chunks``, or 1 when that is 0). Every operator works inside one window: a
shuffle permutes only the window's records, packing closes every bin at the window's end. So
the lane's record stream is the concatenation of its windows, and window ``w`` depends only on
the chunks ``[w*k, (w+1)*k)`` of the lane: that is what makes a restore exact while re-reading
no more than one window.

A lane's position is therefore ``(window, cursor)``: the window holding the next undelivered
record and how many entries of that window's order were consumed (a record a map dropped
counts as consumed). Records before a pack are kept as positions into the window's raw rows
and mapped only when they are delivered, so skipping ``cursor`` entries on restore maps
nothing; after a pack the window is materialised when it is built, the same cost fresh or
restored.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from zephon.pipeline.operators import MapOp, Operator, PackOp, ShuffleOp, jitter_order
from zephon.pipeline.packing import pack_first_fit
from zephon.pipeline.records import Batch
from zephon.pipeline.work_source import Chunk, StaticMixtureWorkSource, derive_seed

__all__ = ["LanePlan", "LaneProgress", "LaneReader", "Window"]


@dataclass(frozen=True, slots=True)
class LaneProgress:
    """Delivered progress of one lane: the state dict's unit (see ``state.py``)."""

    window: int = 0
    cursor: int = 0
    batches: int = 0


@dataclass(frozen=True, slots=True)
class LanePlan:
    """What every lane of a pipeline shares: the curriculum, the operators, the geometry."""

    source: StaticMixtureWorkSource
    ops: tuple[Operator, ...]
    lanes: int
    window_chunks: int

    def window_chunk_list(self, lane: int, window: int) -> list[Chunk]:
        chunks = []
        for j in range(window * self.window_chunks, (window + 1) * self.window_chunks):
            chunk = self.source.lane_chunk(lane, j, self.lanes)
            if chunk is None:
                break
            chunks.append(chunk)
        return chunks

    def build_window(self, lane: int, window: int) -> Window | None:
        """Window ``window`` of ``lane`` after every operator, or ``None`` past the lane's end."""
        chunks = self.window_chunk_list(lane, window)
        if not chunks:
            return None
        return Window(self, lane, window, chunks)


class Window:
    """One flush window of one lane: its entries in final order, mapped lazily on fetch."""

    __slots__ = ("lane", "index", "chunks", "starts", "base", "members", "order", "maps", "size")

    def __init__(self, plan: LanePlan, lane: int, index: int, chunks: list[Chunk]) -> None:
        self.lane = lane
        self.index = index
        self.chunks = chunks
        self.starts: list[int] = []
        raw: list[Any] = []
        for chunk in chunks:
            self.starts.append(len(raw))
            raw += plan.source.read(chunk)
        self.base: list[Any] = raw
        self.members: list[tuple[int, ...]] | None = None  # set once a pack regrouped records
        self.order: list[int] | None = None  # None: base order
        self.maps: list[MapOp] = []
        for op_index, op in enumerate(plan.ops):
            if isinstance(op, MapOp):
                self.maps.append(op)
            elif isinstance(op, ShuffleOp):
                n = len(self.base) if self.order is None else len(self.order)
                seed = derive_seed("shuffle", op.seed, lane, index, op_index)
                perm = jitter_order(n, op.buffer_size, seed)
                self.order = perm if self.order is None else [self.order[i] for i in perm]
            elif isinstance(op, PackOp):
                payloads, positions, _ = self.fetch(0, self._entries())
                provs = positions if self.members is None else [self.members[p] for p in positions]
                provs = [p if isinstance(p, tuple) else (p,) for p in provs]
                self.base, self.members = pack_first_fit(payloads, provs, op)
                self.order = None
                self.maps = []
        self.size = self._entries()

    def _entries(self) -> int:
        return len(self.base) if self.order is None else len(self.order)

    def fetch(self, start: int, stop: int) -> tuple[list[Any], list[int], list[int] | None]:
        """Records of entries ``[start, stop)``: payloads, base positions, and the entry index
        of each kept record (``None`` when none was dropped, i.e. entry = ``start + i``)."""
        base = self.base
        if self.order is None:
            positions = list(range(start, min(stop, len(base))))
            payloads = base[start:stop]
        else:
            positions = self.order[start:stop]
            payloads = [base[p] for p in positions]
        entries: list[int] | None = None
        for op in self.maps:
            payloads = list(map(op.fn, payloads))
            if op.drop_none:
                keep = [i for i, x in enumerate(payloads) if x is not None]
                if len(keep) != len(payloads):
                    payloads = [payloads[i] for i in keep]
                    positions = [positions[i] for i in keep]
                    if entries is None:
                        entries = [start + i for i in keep]
                    else:
                        entries = [entries[i] for i in keep]
        return payloads, positions, entries

    def provenance(self, position: int) -> tuple[int, int, str, tuple]:
        """``(chunk, offset, sample_id, members)`` of the record at base ``position``."""
        if self.members is None:
            chunk, offset, sample_id = self._raw_provenance(position)
            return chunk, offset, sample_id, ()
        members = tuple(self._raw_provenance(p) for p in self.members[position])
        first = members[0]
        return first[0], first[1], first[2], members

    def _raw_provenance(self, position: int) -> tuple[int, int, str]:
        i = bisect.bisect_right(self.starts, position) - 1
        chunk = self.chunks[i]
        offset = position - self.starts[i]
        return chunk.index, offset, chunk.sample_id(offset)


class _Segment:
    """Fetched entries ``[lo, hi)`` of a window, and how many of its records were taken."""

    __slots__ = ("lo", "hi", "payloads", "positions", "entries", "taken")

    def __init__(self, lo: int, hi: int, fetched: tuple) -> None:
        self.lo, self.hi = lo, hi
        self.payloads, self.positions, self.entries = fetched
        self.taken = 0

    def cursor_after(self, taken: int) -> int:
        """The window cursor once ``taken`` records of this segment are delivered."""
        if taken >= len(self.payloads):
            return self.hi  # dropped entries at the segment's tail are consumed too
        last = self.entries[taken - 1] if self.entries is not None else self.lo + taken - 1
        return last + 1


class _Segments:
    """Fetches a window's entries from ``start`` on in fixed-size segments, maybe in parallel.

    Segment boundaries depend only on ``start`` and ``size``, and each fetch is a pure
    function of the window, so using a pool changes timing but never the output.
    """

    def __init__(
        self, window: Window, start: int, size: int, pool: Executor | None, lookahead: int
    ) -> None:
        self.window = window
        self.next_start = start
        self.size = size
        self.pool = pool
        self.lookahead = lookahead
        self.pending: deque = deque()

    def _bounds(self) -> tuple[int, int]:
        lo = self.next_start
        self.next_start = min(lo + self.size, self.window.size)
        return lo, self.next_start

    def _submit(self) -> None:
        while len(self.pending) < self.lookahead and self.next_start < self.window.size:
            lo, hi = self._bounds()
            self.pending.append((lo, hi, self.pool.submit(self.window.fetch, lo, hi)))

    def next(self) -> _Segment | None:
        if self.pool is None:
            if self.next_start >= self.window.size:
                return None
            lo, hi = self._bounds()
            return _Segment(lo, hi, self.window.fetch(lo, hi))
        self._submit()
        if not self.pending:
            return None
        lo, hi, future = self.pending.popleft()
        self._submit()
        return _Segment(lo, hi, future.result())


class LaneReader:
    """Cuts one lane's record stream into microbatches, starting from a ``LaneProgress``.

    ``window_index``/``cursor`` are the position after the last batch returned (what the state
    reports once that batch is delivered); reading may run ahead of it into buffered segments.
    """

    def __init__(
        self,
        plan: LanePlan,
        lane: int,
        progress: LaneProgress,
        pool: Executor | None = None,
        parallelism: int = 1,
    ) -> None:
        self.plan = plan
        self.lane = lane
        self.window_index = progress.window
        self.cursor = progress.cursor
        self.batches = progress.batches
        self.pool = pool
        self.lookahead = max(2, 2 * parallelism)
        self._window: Window | None = None
        self._segments: _Segments | None = None
        self._segment: _Segment | None = None
        self.exhausted = False

    def progress(self) -> LaneProgress:
        return LaneProgress(self.window_index, self.cursor, self.batches)

    def _open_window(self, index: int, cursor: int, size: int) -> Window | None:
        window = self.plan.build_window(self.lane, index)
        self._window = window
        self._segment = None
        if window is not None:
            self._segments = _Segments(window, cursor, size, self.pool, self.lookahead)
        return window

    def next_batch(self, size: int, drop_last: bool) -> tuple[Batch, LaneProgress] | None:
        """The next microbatch and the lane's progress once it is delivered, or ``None`` at the
        lane's end (a final partial batch is returned unless ``drop_last``)."""
        if self.exhausted:
            return None
        payloads: list[Any] = []
        parts: list[tuple[Window, list[int]]] = []
        window_index, cursor = self.window_index, self.cursor
        need = size
        while need:
            window = self._window
            if window is None or window.index != window_index:
                window = self._open_window(window_index, cursor, size)
                if window is None:
                    break  # past the lane's last chunk
            segment = self._segment or self._segments.next()
            if segment is None:
                window_index, cursor = window_index + 1, 0
                continue
            take = min(need, len(segment.payloads) - segment.taken)
            if take:
                lo, hi = segment.taken, segment.taken + take
                payloads += segment.payloads[lo:hi]
                if parts and parts[-1][0] is window:
                    parts[-1][1].extend(segment.positions[lo:hi])
                else:
                    parts.append((window, list(segment.positions[lo:hi])))
                need -= take
                segment.taken = hi
            cursor = segment.cursor_after(segment.taken) if segment.taken else segment.hi
            self._segment = segment if segment.taken < len(segment.payloads) else None
            if cursor >= window.size:
                window_index, cursor = window_index + 1, 0
        if not payloads or (need and drop_last):
            # The end of the lane; a drop_last remainder is never delivered, so the position
            # stays before it and a restore drops the same records.
            self.exhausted = True
            return None
        self.window_index, self.cursor = window_index, cursor
        self.batches += 1
        return Batch(self.lane, payloads, parts), self.progress()


def owned_lanes(canonical_replicas: int, dp_degree: int, dp_group_id: int) -> list[int]:
    """Lanes ``l`` with ``l % dp_degree == dp_group_id``: what one data-parallel group reads."""
    return [lane for lane in range(canonical_replicas) if lane % dp_degree == dp_group_id]


def next_lane(active: Sequence[int], readers: dict[int, LaneReader]) -> int:
    """The owned lane to read next: fewest batches delivered, ties to the lowest lane.

    In steady state this is plain round-robin; after an elastic restore that merged lanes of
    different groups it first evens their counts out, which is what keeps global steps aligned.
    """
    return min(active, key=lambda lane: (readers[lane].batches, lane))
