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
run restarted with the same ``run_id``), and the live rank replaces it. Parts are created with
the storage layer's create-only protocols (local disk: temp file + link; S3/GCS: conditional
PUT), so rank 0 never reads half a part; finding a part already there means a leftover, which
the writing rank removes before creating its own.

Rank 0 polls until all ``world_size - 1`` other parts exist or ``aggregate_timeout_s`` passes,
merges, then deletes that key and older keys of the run: nothing in the directory is needed
once a checkpoint is assembled. A non-zero rank writes its part and returns at once; it may
already be at its next checkpoint (next key) while rank 0 is still merging this one, which is
why rank 0 never deletes keys newer than its own.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from storage.backend import backend_errors, list_files, read_small, remove_empty_dirs, remove_files
from storage.commit import marker_protocol_for
from storage.errors import StorageError
from storage.location import open_location
from zephon.pipeline.errors import AggregationError, AggregationTimeoutError

__all__ = ["Aggregator", "aggregation_key"]


def aggregation_key(epoch: str, seq: int) -> str:
    return f"{epoch}-{seq:08d}"


def _parse_key(name: str) -> tuple[str, int] | None:
    epoch, _, seq = name.rpartition("-")
    return (epoch, int(seq)) if epoch and seq.isdigit() else None


class Aggregator:
    """The shared-directory protocol for one pipeline process (one rank)."""

    def __init__(
        self,
        url: str,
        storage_options: dict | None,
        run_id: str,
        *,
        world_size: int,
        rank: int,
        timeout_s: float,
        poll_interval_s: float = 0.2,
    ) -> None:
        self.location = open_location(url, storage_options)
        self._create = marker_protocol_for(self.location).create
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
        location = self.location
        with backend_errors(location, f"writing pipeline checkpoint part {path}"):
            if location.is_local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                self._create(location.fs, path, data)
            except FileExistsError:
                # A leftover of an earlier attempt under the same key: never this rank's own
                # part of this checkpoint, since every checkpoint() call takes a new key.
                remove_files(location, [path])
                self._create(location.fs, path, data)

    def _present(self, key: str) -> set[int]:
        directory = self._key_dir(key)
        with backend_errors(self.location, f"listing {directory}"):
            self.location.fs.invalidate_cache(directory)
            files = list_files(self.location, directory)
        ranks = set()
        for listed in files:
            base = listed.path.rsplit("/", 1)[-1]
            digits = base[5:-5] if base.startswith("rank-") and base.endswith(".json") else ""
            if digits.isdigit():
                ranks.add(int(digits))
        return ranks

    def _read(self, key: str, rank: int) -> Any:
        path = self._part_path(key, rank)
        with backend_errors(self.location, f"reading {path}"):
            data = read_small(self.location, path)
        try:
            return json.loads(data)
        except ValueError as exc:
            raise AggregationError(
                f"the pipeline checkpoint part {self.location.display(path)} is not JSON "
                f"({exc}); remove it and checkpoint again",
                run_id=self.run_id,
                url=self.location.url,
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
                    missing_ranks=sorted(missing),
                    timeout_s=self.timeout_s,
                    run_id=self.run_id,
                    url=self.location.url,
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, self.poll_interval_s)
        return [accepted[rank] for rank in sorted(accepted)]

    def cleanup(self, key: str) -> None:
        """Rank 0, after merging: remove ``key``, older keys of this epoch and every key of
        other epochs. Best effort: a leftover costs space, never correctness."""
        current = _parse_key(key)
        location = self.location
        run_dir = location.join(self.run_id)
        try:
            with backend_errors(location, f"cleaning up {run_dir}"):
                location.fs.invalidate_cache(run_dir)
                doomed: dict[str, list[str]] = {}
                for listed in list_files(location, run_dir):
                    rest = (
                        listed.path[len(run_dir) + 1 :] if listed.path.startswith(run_dir) else ""
                    )
                    name = rest.split("/", 1)[0]
                    parsed = _parse_key(name)
                    if parsed is None or current is None:
                        continue
                    if parsed[0] != current[0] or parsed[1] <= current[1]:
                        doomed.setdefault(name, []).append(listed.path)
                remove_files(location, [p for paths in doomed.values() for p in paths])
                # Only the removed keys' directories: a rank may be creating a newer key's
                # directory under run_dir right now.
                for name in doomed:
                    remove_empty_dirs(location, location.join(self.run_id, name))
        except (OSError, StorageError):
            pass
