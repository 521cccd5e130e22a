"""The curriculum: a deterministic sequence of work chunks over one or more datasets.

A *chunk* is ``chunk_size`` consecutive records of a dataset's pass (the last chunk of a pass
may be shorter, and is never dropped). Each pass orders the dataset's shards (shuffled per pass
when ``shuffle_shards``), concatenates them and cuts the result into chunks, so a chunk may span
a shard boundary. Datasets are interleaved by weight: the next chunk always comes from the
dataset that is furthest behind its share (records taken / weight), ties to the earlier one.
Chunk ``k`` of the curriculum goes to lane ``k % canonical_replicas``.

``exhausted_policy`` says what happens when a dataset has made its ``stop_after_passes``
passes: ``"leave"`` (it leaves the mixture, the others go on; the curriculum ends with the last
one), ``"stop"`` (the whole curriculum ends there, so the weights hold to the end) or
``"repeat"`` (every dataset starts its next pass at once, forever: an endless curriculum in
which the weights always hold).

Nothing here reads records: planning uses shard lengths only, so it is cheap and identical on
every rank, in every run with the same configuration.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zephon.errors import ConfigError
from zephon.pipeline.dataset import Dataset, ShardId
from zephon.pipeline.mixture import MixtureSpec, resolve_weights

__all__ = ["EXHAUSTED_POLICIES", "Chunk", "StaticMixtureWorkSource", "derive_seed"]

_RECENT_CHUNKS = 1 << 16
EXHAUSTED_POLICIES = ("leave", "stop", "repeat")


class _Unset:
    """``stop_after_passes`` left at its default: 1 pass, or endless with ``"repeat"``."""

    def __repr__(self) -> str:
        return "1"


_UNSET: Any = _Unset()


def derive_seed(*parts: Any) -> int:
    """A 64-bit seed from any tuple of ints and strings, the same on every machine and run."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One unit of work: records ``segments`` of dataset ``dataset`` (pass ``pass_index``).

    ``index`` is the chunk's position in the whole curriculum (its id in provenance);
    ``segments`` are ``(shard_id, start, stop)`` ranges read in order.
    """

    index: int
    dataset: str
    pass_index: int
    segments: tuple[tuple[ShardId, int, int], ...]
    size: int

    def read(self, dataset: Dataset) -> list[Any]:
        rows: list[Any] = []
        for shard_id, start, stop in self.segments:
            rows += dataset.shards[shard_id].read(start, stop)
        return rows

    def sample_id(self, offset: int) -> str:
        """``"<dataset>/<shard>/<row>"`` of the record at ``offset`` within this chunk (an int
        shard id is written in decimal; a dataset's ids are all ints or all strings)."""
        if not 0 <= offset < self.size:
            raise IndexError(f"offset {offset} outside chunk {self.index} of {self.size} records")
        for shard_id, start, stop in self.segments:
            if offset < stop - start:
                return f"{self.dataset}/{shard_id}/{start + offset}"
            offset -= stop - start
        raise AssertionError("unreachable: segments cover size")


class StaticMixtureWorkSource:
    """A deterministic curriculum of work chunks from datasets mixed by weight.

    Args:
        datasets: one ``Dataset`` or a sequence of them (names must differ).
        mixture: weights, as a ``MixtureSpec``, a mapping from dataset name or a sequence
            parallel to ``datasets``; ``None`` weighs each dataset by its record count, so all
            finish a pass together. Weights set the share of *records* each dataset contributes.
        chunk_size: records per work chunk; the unit of lane assignment and of replay.
        seed: seeds the per-pass shard order.
        shuffle_shards: shuffle the shard order in every pass, from ``seed`` and the pass index
            (otherwise sorted by shard id).
        stop_after_passes: passes over each dataset before it is exhausted (default 1; ``None``:
            never, an endless curriculum). Must stay unset (or ``None``) with ``"repeat"``.
        exhausted_policy: what an exhausted dataset does. ``"leave"`` (default): it leaves
            the mixture and the others continue on their own, so the weights hold only until
            the first dataset finishes. ``"stop"``: the curriculum ends when the first dataset
            is exhausted. ``"repeat"``: each dataset starts its next pass (reshuffled) as soon as
            it finishes one, forever, and the weights hold throughout.
    """

    def __init__(
        self,
        datasets: Dataset | Sequence[Dataset],
        mixture: MixtureSpec | Mapping[str, float] | Sequence[float] | None = None,
        *,
        chunk_size: int = 1024,
        seed: int = 0,
        shuffle_shards: bool = True,
        stop_after_passes: int | None = _UNSET,
        exhausted_policy: str = "leave",
    ) -> None:
        if isinstance(datasets, Dataset):
            datasets = [datasets]
        datasets = list(datasets)
        if not datasets or not all(isinstance(d, Dataset) for d in datasets):
            raise ConfigError(
                "datasets must be a Dataset or a non-empty sequence of Dataset objects, got "
                f"{datasets!r}"
            )
        names = [d.name for d in datasets]
        if len(set(names)) != len(names):
            raise ConfigError(f"datasets must have distinct names, got {names}")
        _check_int("chunk_size", chunk_size, minimum=1)
        _check_int("seed", seed, minimum=0)
        if not isinstance(exhausted_policy, str) or exhausted_policy not in EXHAUSTED_POLICIES:
            raise ConfigError(
                f"exhausted_policy must be 'leave', 'stop' or 'repeat', got {exhausted_policy!r}"
            )
        if exhausted_policy == "repeat":
            if stop_after_passes is not _UNSET and stop_after_passes is not None:
                raise ConfigError(
                    "exhausted_policy='repeat' repeats every dataset forever, so "
                    f"stop_after_passes must be left unset or None, got {stop_after_passes!r}; "
                    "to end after N passes use exhausted_policy='leave' or 'stop' with "
                    "stop_after_passes=N"
                )
            stop_after_passes = None
        elif stop_after_passes is _UNSET:
            stop_after_passes = 1
        if stop_after_passes is not None:
            _check_int("stop_after_passes", stop_after_passes, minimum=1, none_ok=True)
        if not isinstance(shuffle_shards, bool):
            raise ConfigError(f"shuffle_shards must be True or False, got {shuffle_shards!r}")
        self.datasets = {d.name: d for d in datasets}
        self._order = names
        self.chunk_size = chunk_size
        self.seed = seed
        self.shuffle_shards = shuffle_shards
        self.stop_after_passes = stop_after_passes
        self.exhausted_policy = exhausted_policy
        self._mixture_arg = mixture
        self._weights: list[float] | None = None
        if mixture is not None:
            self._weights = resolve_weights(mixture, names)
        self._lock = threading.Lock()
        # A sliding cache of recently planned chunks: lanes advance together, so lookups stay
        # near a moving front; an older index is planned again from the start (rare, and
        # cheap: no data is read, and chunks before it are skipped by size, never built).
        # Keeps memory flat over endless curricula.
        self._recent: deque[Chunk] = deque(maxlen=_RECENT_CHUNKS)
        self._end: int | None = None  # number of chunks, once the curriculum ran out
        self._planner: _Planner | None = None
        self._shard_lengths: dict[str, list[tuple[ShardId, int]]] | None = None

    # -- planning -------------------------------------------------------------------------------

    def _lengths(self) -> dict[str, list[tuple[ShardId, int]]]:
        if self._shard_lengths is None:
            self._shard_lengths = {
                name: [(sid, len(shard)) for sid, shard in self.datasets[name].shards.items()]
                for name in self._order
            }
        return self._shard_lengths

    def _pass_chunks(self, name: str, pass_index: int) -> list[tuple[tuple, int]]:
        shards = list(self._lengths()[name])
        if self.shuffle_shards:
            random.Random(derive_seed("shards", self.seed, name, pass_index)).shuffle(shards)
        out: list[tuple[tuple, int]] = []
        segments: list[tuple[ShardId, int, int]] = []
        fill = 0
        for shard_id, length in shards:
            start = 0
            while start < length:
                take = min(length - start, self.chunk_size - fill)
                segments.append((shard_id, start, start + take))
                start += take
                fill += take
                if fill == self.chunk_size:
                    out.append((tuple(segments), fill))
                    segments, fill = [], 0
        if fill:
            out.append((tuple(segments), fill))  # the last, partial chunk is part of the pass
        return out

    def chunk(self, index: int) -> Chunk | None:
        """Chunk ``index`` of the curriculum, or ``None`` past its end."""
        with self._lock:
            recent = self._recent
            if self._end is not None and index >= self._end:
                return None
            if recent and recent[0].index <= index <= recent[-1].index:
                return recent[index - recent[0].index]
            planner = self._planner
            if planner is None or index < planner.index:
                # First use, or behind the cache: plan again from the start.
                planner = self._planner = _Planner(self)
                recent.clear()
            if not recent or index - planner.index > _RECENT_CHUNKS:
                # Nothing cached leads up to ``index`` (first use, a restore deep into the run,
                # a jump past the cache): advance by chunk sizes alone, building no chunk
                # before it (a few microseconds per chunk of a mixture; a dataset alone
                # skips whole passes).
                planner.skip_to(index)
                recent.clear()
            while planner.index <= index:
                chunk = planner.next()
                if chunk is None:
                    self._end = planner.index
                    return None
                recent.append(chunk)
            return recent[index - recent[0].index]

    def lane_chunk(self, lane: int, position: int, lanes: int) -> Chunk | None:
        """The ``position``-th chunk (0-based) of ``lane`` when there are ``lanes`` lanes."""
        return self.chunk(position * lanes + lane)

    def read(self, chunk: Chunk) -> list[Any]:
        """The records of ``chunk``, in order."""
        return chunk.read(self.datasets[chunk.dataset])

    def fingerprint(self) -> str:
        """A short digest of everything that shapes the curriculum, stored in pipeline state.

        Shard ids and lengths are included, so a dataset that changed on disk is noticed at
        ``restore()`` instead of silently shifting every position. Ids enter by ``repr``, so
        shard ``0`` and shard ``"0"`` make different digests.
        """
        parts: tuple = (
            [(name, self._lengths()[name]) for name in self._order],
            self._weights,
            self.chunk_size,
            self.seed,
            self.shuffle_shards,
            self.stop_after_passes,
        )
        if self.exhausted_policy == "stop":
            # Only "stop" plans another curriculum from the same passes ("repeat" is
            # stop_after_passes=None); adding the others would change every existing digest.
            parts += ("stop",)
        return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()

    def __repr__(self) -> str:
        return (
            f"StaticMixtureWorkSource({self._order}, mixture={self._mixture_arg!r}, "
            f"chunk_size={self.chunk_size}, seed={self.seed}, "
            f"stop_after_passes={self.stop_after_passes}, "
            f"exhausted_policy={self.exhausted_policy!r})"
        )


class _Planner:
    """The curriculum's scheduling state, advanced one chunk at a time.

    Every pass of a dataset cuts the same sizes (``chunk_size``, then the pass's remainder),
    whatever its shard order, and the schedule depends only on sizes: so ``skip_to`` can move
    the state forward without building chunks or shuffling a pass, and ``next`` builds the
    chunk at the current position from that pass's plan.
    """

    def __init__(self, source: StaticMixtureWorkSource) -> None:
        lengths = source._lengths()
        self.source = source
        self.names = source._order
        totals = self.totals = [sum(n for _, n in lengths[x]) for x in self.names]
        size = source.chunk_size
        self.weights = source._weights or [float(t) or 1.0 for t in totals]
        self.counts = [-(-t // size) for t in totals]  # chunks per pass
        self.last = [t - (c - 1) * size for t, c in zip(totals, self.counts, strict=True)]
        self.taken = [0] * len(totals)  # records taken from each dataset
        self.passes = [0] * len(totals)
        self.position = [0] * len(totals)  # chunk position within the current pass
        self.plans: list[list[tuple[tuple, int]] | None] = [None] * len(totals)
        self.active = [t > 0 for t in totals]
        self.index = 0  # curriculum index of the next chunk
        self.done = False

    def _pick(self) -> int | None:
        """The active dataset furthest behind its share, ties to the earlier one."""
        best, best_share = None, 0.0
        for j, live in enumerate(self.active):
            if live:
                share = self.taken[j] / self.weights[j]
                if best is None or share < best_share:
                    best, best_share = j, share
        if best is None:
            self.done = True
        return best

    def _advance(self, i: int, size: int) -> None:
        self.index += 1
        self.taken[i] += size
        self.position[i] += 1
        if self.position[i] == self.counts[i]:
            self.passes[i] += 1
            self.position[i] = 0
            self.plans[i] = None
            stop = self.source.stop_after_passes
            if stop is not None and self.passes[i] >= stop:
                if self.source.exhausted_policy == "stop":
                    self.done = True
                else:
                    self.active[i] = False

    def skip_to(self, index: int) -> None:
        size = self.source.chunk_size
        endless = self.source.stop_after_passes is None
        while self.index < index and not self.done:
            i = self._pick()
            if i is None:
                return
            if endless and self.position[i] == 0 and sum(self.active) == 1:
                # The only non-empty dataset of an endless curriculum: whole passes at once.
                whole = (index - self.index) // self.counts[i]
                if whole:
                    self.index += whole * self.counts[i]
                    self.taken[i] += whole * self.totals[i]
                    self.passes[i] += whole
                    continue
            self._advance(i, self.last[i] if self.position[i] == self.counts[i] - 1 else size)

    def next(self) -> Chunk | None:
        if self.done:
            return None
        i = self._pick()
        if i is None:
            return None
        plan = self.plans[i]
        if plan is None:
            plan = self.plans[i] = self.source._pass_chunks(self.names[i], self.passes[i])
        segments, size = plan[self.position[i]]
        chunk = Chunk(self.index, self.names[i], self.passes[i], segments, size)
        self._advance(i, size)
        return chunk


def _check_int(name: str, value: Any, *, minimum: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or None" if none_ok else "")
        raise ConfigError(f"{name} must be {allowed}, got {value!r}")
