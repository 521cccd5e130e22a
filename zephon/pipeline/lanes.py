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
from dataclasses import dataclass
from typing import Any

from zephon.pipeline.operators import MapOp, Operator, PackOp, ShuffleOp, jitter_order
from zephon.pipeline.packing import pack_first_fit
from zephon.pipeline.parallel import Fetched, InlineMapper, Mapper, MapStage, apply_maps, finish
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

    def build_window(self, lane: int, window: int, mapper: Mapper | None = None) -> Window | None:
        """Window ``window`` of ``lane`` after every operator, or ``None`` past the lane's end.

        ``mapper`` runs the maps a pack needs the whole window for (default: on this thread).
        """
        chunks = self.window_chunk_list(lane, window)
        if not chunks:
            return None
        return Window(self, lane, window, chunks, mapper or InlineMapper())


class Window:
    """One flush window of one lane: its entries in final order, mapped lazily on fetch."""

    __slots__ = ("lane", "index", "chunks", "starts", "base", "members", "order", "stages", "size")

    def __init__(
        self, plan: LanePlan, lane: int, index: int, chunks: list[Chunk], mapper: Mapper
    ) -> None:
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
        self.stages: tuple[MapStage, ...] = ()  # maps since the last pack, applied on fetch
        for op_index, op in enumerate(plan.ops):
            if isinstance(op, MapOp):
                self.stages += ((op_index, op.fn, op.drop_none),)
            elif isinstance(op, ShuffleOp):
                seed = derive_seed("shuffle", op.seed, lane, index, op_index)
                perm = jitter_order(self.entries(), op.buffer_size, seed)
                self.order = perm if self.order is None else list(map(self.order.__getitem__, perm))
            elif isinstance(op, PackOp):
                payloads, positions = mapper.fetch_all(self)
                provs = positions if self.members is None else [self.members[p] for p in positions]
                provs = [p if isinstance(p, tuple) else (p,) for p in provs]
                self.base, self.members = pack_first_fit(payloads, provs, op)
                self.order = None
                self.stages = ()
        self.size = self.entries()

    def entries(self) -> int:
        return len(self.base) if self.order is None else len(self.order)

    def select(self, start: int, stop: int) -> tuple[list[Any], list[int]]:
        """Unmapped records of entries ``[start, stop)`` and their base positions."""
        base = self.base
        if self.order is None:
            stop = min(stop, len(base))
            return base[start:stop], list(range(start, stop))
        positions = self.order[start:stop]
        return list(map(base.__getitem__, positions)), positions

    def fetch(self, start: int, stop: int) -> Fetched:
        """Records of entries ``[start, stop)``: payloads, base positions, and the entry index
        of each kept record (``None`` when none was dropped, i.e. entry = ``start + i``)."""
        raw, positions = self.select(start, stop)
        payloads, keep = apply_maps(self.stages, raw)
        return finish(start, payloads, positions, keep)

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


class _Block:
    """Mapped entries ``[lo, hi)`` of a window, and how many of its records were taken.

    A block is a run of whole *segments*: ``size`` entries each (the microbatch size), counted
    from ``origin``, the entry the lane started the window at. The window cursor reported after
    a batch is defined per segment, so it is the same however many segments a block holds (one
    when maps run inline, a work unit's worth with a pool): that is what keeps checkpoint state
    independent of prefetch and parallelism.
    """

    __slots__ = ("window", "origin", "lo", "hi", "payloads", "positions", "entries", "taken")

    def __init__(self, window: Window, origin: int, lo: int, hi: int, fetched: Fetched) -> None:
        self.window, self.origin, self.lo, self.hi = window, origin, lo, hi
        self.payloads, self.positions, self.entries = fetched
        self.taken = 0

    def cursor_after(self, taken: int, size: int) -> int:
        """The window cursor once ``taken`` (>= 1) records of this block are delivered.

        The entry after the last delivered record, except when that record was the last kept
        one of its segment: then the whole segment is consumed, dropped entries at its tail too.
        """
        entries = self.entries
        if entries is None:
            return self.lo + taken
        last = entries[taken - 1]
        origin = self.origin
        segment_end = min(origin + ((last - origin) // size + 1) * size, self.window.size)
        if taken < len(entries) and entries[taken] < segment_end:
            return last + 1
        return segment_end


class _BlockStream:
    """One lane's blocks in order, window after window, submitted to the mapper ahead of use.

    Block boundaries depend only on where the lane started and the block size, and each fetch
    is a pure function of the window, so a pool changes timing but never the output. With a
    pool, up to ``mapper.lookahead`` blocks are in flight, across window boundaries (the next
    window is built while the last blocks of this one are mapped); inline, nothing is read
    ahead and a window is built only when its first record is needed.
    """

    def __init__(
        self, plan: LanePlan, lane: int, window: int, origin: int, block: int, mapper: Mapper
    ) -> None:
        self.plan, self.lane, self.block, self.mapper = plan, lane, block, mapper
        self.window: Window | None = None  # the window blocks are being submitted from
        self.next_index, self.next_start = window, origin
        self.origin = origin  # where the lane started that window: segments count from there
        self.pending: deque = deque()
        self.end: int | None = None  # the lane's first missing window, once reached

    def _submit(self) -> None:
        while len(self.pending) < self.mapper.lookahead and self.end is None:
            window = self.window
            if window is None:
                window = self.plan.build_window(self.lane, self.next_index, self.mapper)
                if window is None:
                    self.end = self.next_index
                    return
                self.window, self.origin = window, self.next_start
            lo = self.next_start
            hi = min(lo + self.block, window.size)
            # an empty window (a pack of records all dropped) still moves the cursor past it
            handle = self.mapper.submit(window, lo, hi) if hi > lo else None
            self.pending.append((window, self.origin, lo, hi, handle))
            if hi >= window.size:
                self.window, self.next_start = None, 0
                self.next_index += 1
            else:
                self.next_start = hi

    def next(self) -> _Block | None:
        """The next block, or ``None`` past the lane's last window."""
        if not self.pending:
            self._submit()
            if not self.pending:
                return None
        window, origin, lo, hi, handle = self.pending.popleft()
        if self.mapper.lookahead > 1:
            self._submit()  # keep the pool busy while this block is read
        fetched = ([], [], None) if handle is None else self.mapper.result(handle)
        return _Block(window, origin, lo, hi, fetched)


class LaneReader:
    """Cuts one lane's record stream into microbatches, starting from a ``LaneProgress``.

    ``window_index``/``cursor`` are the position after the last batch returned (what the state
    reports once that batch is delivered); reading may run ahead of it into buffered blocks.
    """

    def __init__(
        self, plan: LanePlan, lane: int, progress: LaneProgress, mapper: Mapper | None = None
    ) -> None:
        self.plan = plan
        self.lane = lane
        self.window_index = progress.window
        self.cursor = progress.cursor
        self.batches = progress.batches
        self.mapper = mapper or InlineMapper()
        self._stream: _BlockStream | None = None
        self._block: _Block | None = None
        self.exhausted = False

    def progress(self) -> LaneProgress:
        return LaneProgress(self.window_index, self.cursor, self.batches)

    def next_batch(self, size: int, drop_last: bool) -> tuple[Batch, LaneProgress] | None:
        """The next microbatch and the lane's progress once it is delivered, or ``None`` at the
        lane's end (a final partial batch is returned unless ``drop_last``)."""
        if self.exhausted:
            return None
        stream = self._stream
        if stream is None:
            block = size * max(1, -(-self.mapper.unit // size))  # whole segments
            stream = self._stream = _BlockStream(
                self.plan, self.lane, self.window_index, self.cursor, block, self.mapper
            )
        payloads: list[Any] = []
        parts: list[tuple[Window, list[int]]] = []
        window_index, cursor = self.window_index, self.cursor
        need = size
        while need:
            block = self._block
            if block is None:
                block = stream.next()
                if block is None:
                    window_index, cursor = stream.end, 0  # past the lane's last chunk
                    break
                if block.window.index != window_index:  # the previous window is consumed
                    window_index, cursor = block.window.index, 0
            window = block.window
            available = len(block.payloads) - block.taken
            if available:
                lo = block.taken
                hi = lo + min(need, available)
                if not payloads and lo == 0 and hi == len(block.payloads):
                    payloads, positions = block.payloads, block.positions  # a batch per block
                    parts.append((window, positions))
                else:
                    payloads += block.payloads[lo:hi]
                    if parts and parts[-1][0] is window:
                        parts[-1][1].extend(block.positions[lo:hi])
                    else:
                        parts.append((window, block.positions[lo:hi]))
                need -= hi - lo
                block.taken = hi
                cursor = block.cursor_after(hi, size)
                self._block = block if hi < len(block.payloads) else None
            else:  # every entry of the block was dropped by a map
                cursor = block.hi
                self._block = None
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
