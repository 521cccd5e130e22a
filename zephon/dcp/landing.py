"""Where the bytes of one read group land: the memory of each read's destination, in file order.

A ``Landing`` follows a ``ReadGroup`` (sorted, non-overlapping reads of one file) as its bytes
arrive, whatever brings them: ``segments`` names the memory the next bytes belong in (each
read's destination view, and ``None`` for the bytes between two reads), so a local read is one
``os.preadv`` straight into the tensors and a streamed GET copies each chunk of its reply once,
into the same places. ``landed`` then feeds the new bytes of each checked read to its running
CRC32C while they are still in the CPU cache, and hands every read whose last byte arrived to
``finish`` (which checks the CRC and gives the read to the planner).
"""

from __future__ import annotations

from collections.abc import Callable

from zephon.dcp.read_plan import ReadGroup, SliceRead
from zephon.storage import crc32c_extend

__all__ = ["Landing"]

#: at most this many pieces per ``segments`` call: ``preadv`` takes at most IOV_MAX (1024)
MAX_SEGMENTS = 512


class Landing:
    """The bytes of ``group`` arriving in order from ``group.start``; ``views[i]`` is the
    writable memory of ``group.reads[i]`` (``reads[i].length`` bytes)."""

    __slots__ = ("_crcs", "_finish", "_first", "_group", "_views", "pos")

    def __init__(
        self,
        group: ReadGroup,
        views: list[memoryview],
        finish: Callable[[int, int], None],
    ) -> None:
        """``finish(i, crc)`` is called once read ``i`` has all its bytes (``crc``: their
        CRC32C, 0 for an unchecked read), in file order, from the thread that landed them."""
        self._group = group
        self._views = views
        self._finish = finish
        self._crcs = [0] * len(group.reads)
        #: the first read not finished yet
        self._first = 0
        #: the file offset of the next byte expected
        self.pos = group.start
        self._finish_empty()

    @property
    def done(self) -> bool:
        return self.pos >= self._group.end

    def segments(self, end: int) -> tuple[list[tuple[memoryview | None, int]], int]:
        """The places of bytes ``[pos, end)`` in order, as ``(view, length)``: a piece of a
        destination, or ``(None, length)`` for bytes between reads; and the offset they reach
        (before ``end`` when there would be more than ``MAX_SEGMENTS`` pieces)."""
        out: list[tuple[memoryview | None, int]] = []
        pos = self.pos
        reads = self._group.reads
        i = self._first
        while pos < end and len(out) < MAX_SEGMENTS and i < len(reads):
            r = reads[i]
            if pos < r.start:
                gap = min(r.start, end) - pos
                out.append((None, gap))
                pos += gap
                continue
            stop = min(r.start + r.length, end)
            if stop > pos:
                out.append((self._views[i][pos - r.start : stop - r.start], stop - pos))
                pos = stop
            i += 1
        return out, pos

    def landed(self, count: int) -> None:
        """``count`` more bytes are in place (from ``pos`` on): checksum them and finish every
        read they complete."""
        end = self.pos + count
        reads = self._group.reads
        i = self._first
        while i < len(reads):
            r = reads[i]
            r_end = r.start + r.length
            if r.start >= end:
                break
            lo, hi = max(self.pos, r.start), min(end, r_end)
            if r.crc is not None and hi > lo:
                piece = self._views[i][lo - r.start : hi - r.start]
                self._crcs[i] = crc32c_extend(self._crcs[i], piece)
            if r_end > end:
                break
            self._first = i + 1
            self._finish(i, self._crcs[i])
            i += 1
        self.pos = end
        self._finish_empty()

    def feed(self, chunk: memoryview) -> None:
        """Copy ``chunk``, the next bytes of the stream, into place (one copy per byte that a
        read needs; the bytes between reads are skipped) and account for them."""
        taken = 0
        while taken < chunk.nbytes:
            pieces, reached = self.segments(self.pos + chunk.nbytes - taken)
            for view, length in pieces:
                if view is not None:
                    view[:] = chunk[taken : taken + length]
                taken += length
            if reached == self.pos:
                raise ValueError(f"{chunk.nbytes - taken} bytes past the end of the group")
            self.landed(reached - self.pos)

    def _finish_empty(self) -> None:
        """Finish reads of no bytes that start where the stream is (they get no segment)."""
        reads: list[SliceRead] = self._group.reads
        while self._first < len(reads):
            r = reads[self._first]
            if r.length or r.start > self.pos:
                return
            self._first += 1
            self._finish(self._first - 1, 0)
