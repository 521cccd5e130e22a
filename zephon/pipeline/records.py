"""What iteration yields: a ``Batch`` of payloads with lazily computed provenance.

The hot path only builds the list of payloads; where each record came from (lane, chunk,
offset in the chunk, sample id) is kept as window positions and turned into ``Record`` tuples
only when asked for, so a training loop that only needs payloads pays nothing for provenance.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from zephon.pipeline.lanes import Window

__all__ = ["Batch", "Record"]


class Record(NamedTuple):
    """One delivered record: its payload and where it came from.

    ``chunk`` is the curriculum index of the work chunk, ``offset`` the record's position in
    that chunk, ``sample_id`` ``"<dataset>/<shard>/<row>"``. A packed record reports its first
    member here and every member, as ``(chunk, offset, sample_id)``, in ``members``.
    """

    payload: Any
    lane: int
    chunk: int
    offset: int
    sample_id: str
    members: tuple[tuple[int, int, str], ...] = ()


class Batch:
    """A microbatch from one lane: ``payloads`` plus provenance on demand.

    ``len(batch)`` is the number of records; iterating or indexing gives ``Record`` tuples.
    """

    __slots__ = ("lane", "payloads", "_parts")

    def __init__(self, lane: int, payloads: list[Any], parts: list[tuple[Window, list[int]]]):
        self.lane = lane
        self.payloads = payloads
        self._parts = parts  # (window, base positions) runs, in delivery order

    def __len__(self) -> int:
        return len(self.payloads)

    def _provenance(self) -> list[tuple[int, int, str, tuple]]:
        out = []
        for window, positions in self._parts:
            out.extend(window.provenance(p) for p in positions)
        return out

    @property
    def records(self) -> list[Record]:
        lane = self.lane
        return [
            Record(payload, lane, chunk, offset, sample_id, members)
            for payload, (chunk, offset, sample_id, members) in zip(
                self.payloads, self._provenance(), strict=True
            )
        ]

    @property
    def sample_ids(self) -> list[str]:
        return [p[2] for p in self._provenance()]

    @property
    def keys(self) -> list[tuple[int, int, int]]:
        """``(lane, chunk, offset)`` of every record: a cheap, unique identity for each."""
        return [(self.lane, p[0], p[1]) for p in self._provenance()]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __getitem__(self, index: int) -> Record:
        return self.records[index]

    def __repr__(self) -> str:
        return f"Batch(lane={self.lane}, {len(self.payloads)} records)"
