"""Assembling one state dict from every rank's progress through a shared directory.

The storage transport of ``Pipeline.checkpoint()`` (``aggregate_dir``, any fsspec URL), for jobs
without torch.distributed; ``zephon.pipeline.aggregate_torch`` is the other one. Layout::

    <aggregate_dir>/<run_id>/<epoch>-<seq>/rank-000003.json     every rank's part
    <aggregate_dir>/<run_id>/<epoch>-<seq>/merged.json          the merged state, from rank 0
    <aggregate_dir>/<run_id>/<epoch>-<seq>/ack-<token>-000003   "rank 3 has read it"

``epoch`` names where this process's progress started (``fresh``, or a digest of the state it
restored) and ``seq`` counts its ``checkpoint()`` calls since then. All ranks start from the
same state and call ``checkpoint()`` at the same steps, so they agree on the key without
talking to each other, and parts of an earlier checkpoint sit under another key. Each part
also says how many batches its rank delivered since the epoch began; in lockstep training that
number is the same on every rank, so rank 0 ignores a part that disagrees with its own count:
that is a leftover of an earlier attempt that reached the same key at another step (a crashed
run restarted with the same ``run_id``), and the live rank replaces it. Files are created with
the storage layer's create-only protocols (local disk: temp file + link; S3/GCS: conditional
PUT), so nobody reads half a file; finding one already there means a leftover, which the
writer removes before creating its own.

One checkpoint, in order:

1. every rank writes its part (rank 0 too: a rank that times out can then name exactly the
   ranks whose part is missing), with a fresh random ``nonce``;
2. rank 0 waits until all ``world_size - 1`` other parts are there (or ``aggregate_timeout_s``
   passes), merges them with ``merge_parts``, deletes the parts, older keys of the run and
   keys of other epochs, then publishes ``merged.json`` holding the state, every part's nonce
   and a random ``token``. Deleting comes before publishing: until ``merged.json`` exists every
   other rank is blocked in this checkpoint, so none can be writing a newer key yet;
3. every other rank waits for a ``merged.json`` carrying its own nonce (so a leftover of an
   earlier attempt is never taken for this checkpoint), returns its state, and writes an ack
   named with the token. A rank that then lists all ``world_size - 1`` acks of the token was the
   last reader and deletes the key: once every rank has read the state nothing is left. Should
   that fail (a crash between ack and delete), rank 0 deletes the key at the next checkpoint,
   because every rank that reached the next key has finished this one.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from zephon.pipeline.errors import AggregationError, AggregationTimeoutError
from zephon.pipeline.state import Identity, merge_parts
from zephon.storage import (
    StorageError,
    create_settled,
    forget_cached,
    list_files,
    make_dirs,
    open_location,
    parse_json,
    parse_number,
    put_small,
    read_small,
    remove_empty_dirs,
    remove_files,
)

__all__ = ["Aggregator", "aggregation_key"]

MERGED_FORMAT = "zephon.pipeline.merged"
MERGED_NAME = "merged.json"


def aggregation_key(epoch: str, seq: int) -> str:
    return f"{epoch}-{seq:08d}"


def _parse_key(name: str) -> tuple[str, int] | None:
    epoch, _, seq = name.rpartition("-")
    number = parse_number(seq)
    return (epoch, number) if epoch and number is not None else None


def _part_rank(path: str) -> int | None:
    base = path.rsplit("/", 1)[-1]
    digits = base[5:-5] if base.startswith("rank-") and base.endswith(".json") else ""
    return parse_number(digits)


class Aggregator:
    """The shared-directory protocol for one pipeline process (one rank); see the module doc."""

    url: str

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
        self.url = self.location.url
        self.run_id = run_id
        self.world_size = world_size
        self.rank = rank
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s

    def checkpoint(self, key: str, part: dict[str, Any], identity: Identity) -> dict[str, Any]:
        """Every rank: publish ``part`` under ``key`` and return the merged state of all ranks.

        Raises ``AggregationTimeoutError`` naming the ranks that did not arrive within
        ``aggregate_timeout_s``, ``AggregationError`` when the parts cannot be merged.
        """
        part = {**part, "nonce": secrets.token_hex(8)}
        self.write_part(key, part)
        if self.rank != 0:
            return self._receive(key, part, identity)
        others = self.gather(key, part["delivered"])
        state = merge_parts([part, *others], identity, run_id=self.run_id, url=self.url)
        self._remove_parts(key)
        self.cleanup(key)
        self._publish(key, state, [part["nonce"]] + [p.get("nonce") for p in others])
        return state

    # -- paths -----------------------------------------------------------------------------------

    def _key_dir(self, key: str) -> str:
        return self.location.join(self.run_id, key)

    def _part_path(self, key: str, rank: int) -> str:
        return self.location.join(self.run_id, key, f"rank-{rank:06d}.json")

    def _merged_path(self, key: str) -> str:
        return self.location.join(self.run_id, key, MERGED_NAME)

    # -- writing ---------------------------------------------------------------------------------

    def _create_replacing(self, path: str, data: bytes, what: str) -> None:
        location = self.location
        make_dirs(location, path.rsplit("/", 1)[0])
        # A lost reply is settled by reading back: these very bytes (they carry a nonce or
        # a token) are this call's file.
        if create_settled(location, path, data).created:
            return
        # A leftover of an earlier attempt under the same key: never this checkpoint's,
        # since every checkpoint() call takes a new key.
        remove_files(location, [path])
        if not create_settled(location, path, data).created:
            raise FileExistsError(path)

    def write_part(self, key: str, part: dict[str, Any]) -> None:
        """Publish this rank's part for ``key``."""
        data = json.dumps(part, separators=(",", ":")).encode()
        self._create_replacing(self._part_path(key, self.rank), data, "pipeline checkpoint part")

    def _publish(self, key: str, state: dict[str, Any], nonces: list[Any]) -> None:
        """Rank 0: make the merged state readable by the other ranks."""
        wrapper = {
            "format": MERGED_FORMAT,
            "key": key,
            "token": secrets.token_hex(8),
            "nonces": nonces,
            "state": state,
        }
        data = json.dumps(wrapper, separators=(",", ":")).encode()
        self._create_replacing(self._merged_path(key), data, "merged pipeline state")

    # -- reading ---------------------------------------------------------------------------------

    def _present(self, key: str) -> set[int]:
        directory = self._key_dir(key)
        forget_cached(self.location, directory)
        files = list_files(self.location, directory)
        return {rank for f in files if (rank := _part_rank(f.path)) is not None}

    def _read_json(self, path: str, what: str) -> Any:
        data = read_small(self.location, path)
        try:
            return parse_json(data)
        except ValueError as exc:
            raise AggregationError(
                f"the {what} {self.location.display(path)} is {exc}; remove it and "
                "checkpoint again",
                run_id=self.run_id,
                url=self.location.url,
            ) from exc

    def _poll(self, attempt: Callable[[], bool]) -> bool:
        """Call ``attempt`` with growing pauses until it returns True (then True) or
        ``aggregate_timeout_s`` passes (then False)."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.005
        while not attempt():
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, self.poll_interval_s)
        return True

    def gather(self, key: str, delivered: int) -> list[dict[str, Any]]:
        """Rank 0: wait for every other rank's part of ``key`` and return them, by rank.

        ``delivered`` is rank 0's count of batches delivered since the epoch began; a part
        with another count is a leftover and is waited past (see the module docstring).
        """
        expected = set(range(1, self.world_size))
        accepted: dict[int, dict[str, Any]] = {}
        stale: dict[int, Any] = {}

        def attempt() -> bool:
            for rank in sorted(self._present(key) & expected - set(accepted)):
                try:
                    part = self._read_json(self._part_path(key, rank), "pipeline checkpoint part")
                except FileNotFoundError:
                    continue
                if isinstance(part, dict) and part.get("delivered") == delivered:
                    accepted[rank] = part
                    stale.pop(rank, None)
                else:
                    stale[rank] = part.get("delivered") if isinstance(part, dict) else None
            return not expected - set(accepted)

        if not self._poll(attempt):
            detail = ""
            if stale:
                detail = (
                    f"; ranks {sorted(stale)} have parts there at another position "
                    f"(batches delivered {stale} vs rank 0's {delivered}): they did not "
                    "checkpoint at the same step, or those are leftovers of an earlier "
                    "attempt with the same run_id"
                )
            raise self._timeout(key, sorted(expected - set(accepted)), detail=detail)
        return [accepted[rank] for rank in sorted(accepted)]

    def _receive(self, key: str, part: dict[str, Any], identity: Identity) -> dict[str, Any]:
        """A rank other than 0: wait for rank 0's merged state of this very checkpoint."""
        path = self._merged_path(key)
        found: dict[str, Any] = {}
        seen_other = False

        def attempt() -> bool:
            nonlocal seen_other
            try:
                merged = self._read_json(path, "merged pipeline state")
            except FileNotFoundError:
                return False
            nonces = merged.get("nonces") if isinstance(merged, dict) else None
            if (
                isinstance(nonces, list)
                and len(nonces) == self.world_size
                and nonces[self.rank] == part["nonce"]
            ):
                found.update(merged)
                return True
            seen_other = True  # a leftover of an earlier attempt; rank 0 will replace it
            return False

        if not self._poll(attempt):
            missing = sorted(set(range(self.world_size)) - self._present(key))
            if not missing:
                raise self._timeout(
                    key,
                    [0],
                    "rank 0 published no merged state",
                    "; every part is there (see rank 0's error)",
                )
            detail = "; the merged state there is a leftover of an earlier attempt"
            raise self._timeout(key, missing, detail=detail if seen_other else "")
        state = found.get("state")
        if not isinstance(state, dict) or state.get("canonical_replicas") != (
            identity.canonical_replicas
        ):
            raise AggregationError(
                f"the merged pipeline state {self.location.display(path)} is malformed; "
                "remove it and checkpoint again",
                run_id=self.run_id,
                url=self.url,
            )
        self._acknowledge(key, str(found.get("token")))
        return state

    def _timeout(
        self, key: str, missing: list[int], what: str = "", detail: str = ""
    ) -> AggregationTimeoutError:
        what = what or f"ranks {missing} did not write their part"
        return AggregationTimeoutError(
            f"pipeline checkpoint {key!r} of run {self.run_id!r} (rank {self.rank}): {what} "
            f"in {self.location.display(self._key_dir(key))} within {self.timeout_s:g} s{detail}; "
            f"every rank in world_size={self.world_size} must call checkpoint() at the same "
            "step (raise aggregate_timeout_s if they are slow)",
            missing_ranks=missing,
            timeout_s=self.timeout_s,
            run_id=self.run_id,
            url=self.location.url,
        )

    # -- cleanup ---------------------------------------------------------------------------------

    def _acknowledge(self, key: str, token: str) -> None:
        """After reading the merged state: the last of the ranks other than 0 deletes the key.

        Best effort: a leftover costs space, never correctness (rank 0 removes it later)."""
        location = self.location
        directory = self._key_dir(key)
        prefix = f"ack-{token}-"
        ack = location.join(self.run_id, key, f"{prefix}{self.rank:06d}")
        try:
            # A plain write: an ack has no content to tear, and a temp file beside it could
            # keep the last reader from removing the directory.
            put_small(location, ack, b"")
            forget_cached(location, directory)
            files = [f.path for f in list_files(location, directory)]
            acks = [p for p in files if p.rsplit("/", 1)[-1].startswith(prefix)]
            if len(acks) == self.world_size - 1:
                remove_files(location, files)
                remove_empty_dirs(location, directory)
        except (OSError, StorageError):
            pass

    def _remove_parts(self, key: str) -> None:
        """Rank 0, once merged: every part of ``key`` (they are read)."""
        directory = self._key_dir(key)
        forget_cached(self.location, directory)
        parts = [f.path for f in list_files(self.location, directory)]
        remove_files(self.location, [p for p in parts if _part_rank(p) is not None])

    def cleanup(self, key: str) -> None:
        """Rank 0, after gathering ``key``: remove older keys of this epoch and every key of
        other epochs (every rank has left them behind, since all wrote their part of ``key``).
        Best effort: a leftover costs space, never correctness."""
        current = _parse_key(key)
        location = self.location
        run_dir = location.join(self.run_id)
        try:
            forget_cached(location, run_dir)
            doomed: dict[str, list[str]] = {}
            for listed in list_files(location, run_dir):
                rest = listed.path[len(run_dir) + 1 :] if listed.path.startswith(run_dir) else ""
                name = rest.split("/", 1)[0]
                parsed = _parse_key(name)
                if parsed is None or current is None:
                    continue
                if parsed[0] != current[0] or parsed[1] < current[1]:
                    doomed.setdefault(name, []).append(listed.path)
            remove_files(location, [p for paths in doomed.values() for p in paths])
            # Only the removed keys' directories: the current key's is still in use.
            for name in doomed:
                remove_empty_dirs(location, location.join(self.run_id, name))
        except (OSError, StorageError):
            pass
