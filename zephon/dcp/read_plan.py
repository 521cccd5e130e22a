"""Which bytes a DCP load plan needs, and which requests fetch them.

``plan_read`` turns one ``ReadItem`` into a byte range of a shard file (the whole saved slice
when its CRC32C is to be checked, else only the rows needed); ``group_reads`` batches
neighbouring ranges of one file into requests of bounded size, so an object store serves a
run of small items with one ranged GET and a whole shard is never downloaded for one tensor.
``zephon.dcp.range_fetch`` then performs the requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.planner import ReadItem

from zephon.dcp.errors import StateDictMismatchError
from zephon.dcp.metadata_codec import ShardSlice, dtype_from_name
from zephon.storage import decode_crc32c

__all__ = ["MIN_SPLIT_BYTES", "ReadGroup", "SliceRead", "group_reads", "plan_read"]

#: the smallest part of a group that ``group_reads`` splits off to give an idle thread work
MIN_SPLIT_BYTES = 8 << 20


@dataclass(slots=True)
class SliceRead:
    """One ReadItem as a byte range of a shard file, and how to view those bytes."""

    req: ReadItem
    file: str
    start: int
    length: int
    dtype: torch.dtype | None  # None: a bytes item
    shape: tuple[int, ...] = ()
    #: (offset, length) per dimension still to cut from the bytes read; None if they are exact
    narrow: tuple[tuple[int, int], ...] | None = None
    #: the CRC32C the bytes read must have (they are then a whole saved slice); None: unchecked
    crc: int | None = None


@dataclass(slots=True)
class ReadGroup:
    """Neighbouring reads of one file fetched as one stream of bytes ``[start, end)``: on local
    disk ``preadv`` calls straight into their destinations, on object stores one ranged GET
    (several when one slice is longer than a request, see ``requests``). The reads are sorted
    and never overlap; the bytes between them are read and dropped."""

    file: str
    start: int
    end: int
    reads: list[SliceRead] = field(default_factory=list)

    def requests(self, max_bytes: int) -> list[tuple[int, int]]:
        """The ``(start, end)`` ranges of the requests that fetch this group, in order: one,
        or consecutive pieces of ``max_bytes`` when the group (then a single slice) is
        longer."""
        return [(s, min(s + max_bytes, self.end)) for s in range(self.start, self.end, max_bytes)]


def plan_read(req: ReadItem, where: ShardSlice, *, check: bool) -> SliceRead:
    """The bytes to read for ``req``. With ``check`` (and a slice that records its CRC32C) the
    read covers the whole saved slice, so its CRC can be checked, and is cut in memory."""
    crc = decode_crc32c(where.crc32c) if check and where.crc32c is not None else None
    if where.encoding == "bytes":
        return SliceRead(req, where.file, where.offset, where.length, None, crc=crc)
    dtype = dtype_from_name(where.dtype or "")
    shape = tuple(where.shape or ())
    offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
    if len(offsets) != len(shape) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape, strict=True)
    ):
        raise StateDictMismatchError(
            f"read of {req.storage_index.fqn!r} at {list(offsets)} size {list(lengths)} lies "
            f"outside the saved chunk of shape {list(shape)}: load into a state shaped as the "
            "one saved"
        )
    if not shape:
        return SliceRead(req, where.file, where.offset, where.length, dtype, shape, crc=crc)
    # When only the first dimension is cut, the rows needed are one contiguous byte range; a
    # checked read takes that shortcut only when the range is the whole slice.
    rows_only = all(
        o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:], strict=True)
    )
    if rows_only and (crc is None or lengths[0] == shape[0]):
        row = math.prod(shape[1:]) * dtype.itemsize
        return SliceRead(
            req,
            where.file,
            where.offset + offsets[0] * row,
            lengths[0] * row,
            dtype,
            (lengths[0], *shape[1:]),
            crc=crc,
        )
    return SliceRead(
        req,
        where.file,
        where.offset,
        where.length,
        dtype,
        shape,
        tuple(zip(offsets, lengths, strict=True)),
        crc=crc,
    )


def group_reads(
    reads: list[SliceRead], max_bytes: int, max_gap: int, *, min_groups: int = 1
) -> list[ReadGroup]:
    """``reads`` batched per file: neighbours at most ``max_gap`` bytes apart share a group of
    at most ``max_bytes`` (a single read longer than that is a group of its own), largest
    group first. A read that overlaps the group before it (two items cut from one saved slice)
    starts a group of its own, so each byte of a group lands in one place. While there are
    fewer than ``min_groups`` groups (the reader threads), the largest one of several reads and
    at least ``2 * MIN_SPLIT_BYTES`` is split between two of them, so every thread has a share
    of the bytes (a small group is not worth a second request)."""
    by_file: dict[str, list[SliceRead]] = {}
    for r in reads:
        by_file.setdefault(r.file, []).append(r)
    groups: list[ReadGroup] = []
    for name, file_reads in by_file.items():
        file_reads.sort(key=lambda r: r.start)
        current: ReadGroup | None = None
        for r in file_reads:
            end = r.start + r.length
            if (
                current is not None
                and current.end <= r.start <= current.end + max_gap
                and end - current.start <= max_bytes
            ):
                current.end = end
                current.reads.append(r)
                continue
            current = ReadGroup(name, r.start, end, [r])
            groups.append(current)
    while len(groups) < min_groups:
        splittable = [
            g for g in groups if len(g.reads) > 1 and g.end - g.start >= 2 * MIN_SPLIT_BYTES
        ]
        if not splittable:
            break
        largest = max(splittable, key=lambda g: g.end - g.start)
        groups.remove(largest)
        groups.extend(_halves(largest))
    # Largest first, so the slowest requests start early.
    groups.sort(key=lambda g: g.end - g.start, reverse=True)
    return groups


def _halves(group: ReadGroup) -> tuple[ReadGroup, ReadGroup]:
    """``group`` (of at least two reads) cut at the read boundary nearest its middle."""
    middle = (group.start + group.end) / 2
    cut = min(range(1, len(group.reads)), key=lambda i: abs(group.reads[i].start - middle))
    first, second = group.reads[:cut], group.reads[cut:]
    last = first[-1]
    return (
        ReadGroup(group.file, group.start, last.start + last.length, first),
        ReadGroup(group.file, second[0].start, group.end, second),
    )
