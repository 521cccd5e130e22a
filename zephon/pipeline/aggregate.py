"""Assembling one state dict from every rank's progress through a shared directory.

Layout under ``aggregate_dir`` (any fsspec URL)::

    <aggregate_dir>/<run_id>/<epoch>-<seq>/rank-000003.json

``epoch`` names where this process's progress started (``fresh``, or a digest of the state it
restored) and ``seq`` counts its ``checkpoint()`` calls since then. All ranks start from the
same state and call ``checkpoint()`` at the same steps, so they agree on the key without
talking to each other, and parts of an earlier checkpoint sit under another key. Each part
also says how many batches its rank delivered since the epoch began; in lockstep training that
number is the same on every rank, so rank 0 ignores a part that disagrees with its own count:
that is a leftover of an earlier attempt that reached the same key at another step (a crashed
run restarted with the same ``run_id``), and the live rank will overwrite it. A part is
written whole (local disk: temp file + rename; object stores: one PUT), so rank 0 never reads
half a part.

Rank 0 polls until all ``world_size - 1`` other parts exist or ``aggregate_timeout_s`` passes,
merges, then deletes that key and older keys of the run: nothing in the directory is needed
once a checkpoint is assembled. A non-zero rank writes its part and returns at once; it may
already be at its next checkpoint (next key) while rank 0 is still merging this one, which is
why rank 0 never deletes keys newer than its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from typing import Any

from zephon.pipeline.errors import AggregationError, AggregationTimeoutError

__all__ = ["Aggregator", "aggregation_key"]


def aggregation_key(epoch: str, seq: int) -> str:
    return f"{epoch}-{seq:08d}"


def _parse_key(name: str) -> tuple[str, int] | None:
    epoch, _, seq = name.rpartition("-")
    return (epoch, int(seq)) if epoch and seq.isdigit() else None


class Aggregator:
    """The shared-directory protocol for one pipeline process (one rank)."""

    def __init__(self, url: str, storage_options: dict | None, run_id: str, *, world_size: int,
                 rank: int, timeout_s: float, poll_interval_s: float = 0.2) -> None:
        from storage.location import open_location

        self.location = open_location(url, storage_options)
        self.run_id = run_id
        self.world_size = world_size
        self.rank = rank
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s

    def _key_dir(self, key: str) -> str:
        return self.location.join(self.run_id, key)

    def _part_path(self, key: str, rank: int) -> str:
        return self.location.join(self.run_id, key, f"rank-{rank:06d}.json")

    def write_part(self, key: str, part: dict[str, Any]) -> None:
        """Publish this rank's part for ``key``; only ranks other than 0 call this."""
        data = json.dumps(part, separators=(",", ":")).encode()
        path = self._part_path(key, self.rank)
        fs = self.location.fs
        try:
            if self.location.is_local:
                directory = os.path.dirname(path)
                os.makedirs(directory, exist_ok=True)
                tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
                with open(tmp, "wb") as handle:
                    handle.write(data)
                os.replace(tmp, path)
            else:
                fs.pipe_file(path, data)
        except OSError as exc:
            raise AggregationError(
                f"rank {self.rank} cannot write its pipeline checkpoint part to "
                f"{self.location.display(path)}: {exc}; check aggregate_dir and its "
                "storage_options", run_id=self.run_id, url=self.location.url,
            ) from exc

    def _present(self, key: str) -> set[int]:
        fs = self.location.fs
        directory = self._key_dir(key)
        try:
            fs.invalidate_cache(directory)
            names = fs.ls(directory, detail=False)
        except FileNotFoundError:
            return set()
        except OSError as exc:
            raise AggregationError(
                f"cannot list {self.location.display(directory)} while assembling a pipeline "
                f"checkpoint: {exc}", run_id=self.run_id, url=self.location.url,
            ) from exc
        ranks = set()
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if base.startswith("rank-") and base.endswith(".json"):
                digits = base[5:-5]
                if digits.isdigit():
                    ranks.add(int(digits))
        return ranks

    def _read(self, key: str, rank: int) -> dict[str, Any]:
        path = self._part_path(key, rank)
        try:
            return json.loads(self.location.fs.cat_file(path))
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:
            raise AggregationError(
                f"cannot read the pipeline checkpoint part {self.location.display(path)}: "
                f"{exc}", run_id=self.run_id, url=self.location.url,
            ) from exc

    def gather(self, key: str, delivered: int) -> list[dict[str, Any]]:
        """Rank 0: wait for every other rank's part of ``key`` and return them, by rank.

        ``delivered`` is rank 0's count of batches delivered since the epoch began; a part
        with another count is a leftover and is waited past (see the module docstring).
        """
        expected = set(range(1, self.world_size))
        accepted: dict[int, dict[str, Any]] = {}
        stale: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        delay = 0.005
        while True:
            for rank in sorted(self._present(key) & expected - set(accepted)):
                try:
                    part = self._read(key, rank)
                except FileNotFoundError:
                    continue
                if isinstance(part, dict) and part.get("delivered") == delivered:
                    accepted[rank] = part
                    stale.pop(rank, None)
                else:
                    stale[rank] = part.get("delivered") if isinstance(part, dict) else None
            missing = expected - set(accepted)
            if not missing:
                break
            if time.monotonic() >= deadline:
                detail = ""
                if stale:
                    detail = (
                        f"; ranks {sorted(stale)} have parts there at another position "
                        f"(batches delivered {stale} vs rank 0's {delivered}): they did not "
                        "checkpoint at the same step, or those are leftovers of an earlier "
                        "attempt with the same run_id"
                    )
                raise AggregationTimeoutError(
                    f"pipeline checkpoint {key!r} of run {self.run_id!r}: ranks "
                    f"{sorted(missing)} did not write their part to "
                    f"{self.location.display(self._key_dir(key))} within "
                    f"{self.timeout_s:g} s{detail}; every rank in world_size={self.world_size} "
                    "must call checkpoint() at the same step (raise aggregate_timeout_s if "
                    "they are slow)",
                    missing_ranks=sorted(missing), timeout_s=self.timeout_s, run_id=self.run_id,
                    url=self.location.url,
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, self.poll_interval_s)
        return [accepted[rank] for rank in sorted(accepted)]

    def cleanup(self, key: str) -> None:
        """Rank 0, after merging: remove ``key``, older keys of this epoch and every key of
        other epochs. Best effort: a leftover costs space, never correctness."""
        current = _parse_key(key)
        fs = self.location.fs
        run_dir = self.location.join(self.run_id)
        try:
            fs.invalidate_cache(run_dir)
            names = fs.ls(run_dir, detail=False)
        except OSError:
            return
        for name in names:
            parsed = _parse_key(name.rstrip("/").rsplit("/", 1)[-1])
            if parsed is None or current is None:
                continue
            if parsed[0] != current[0] or parsed[1] <= current[1]:
                with contextlib.suppress(OSError):
                    fs.rm(name, recursive=True)
