"""The tiers' own config: the local tier's ``local_dir``, ``local_num_to_keep`` and
``max_pending_uploads``, and the memory tier's ``memory_tier``, ``memory_dir``,
``memory_num_to_keep`` and ``memory_replicas``, checked in one place whichever entry point
takes them (the manager's ``trainer.checkpointing`` keys, ``zephon.dcp.Writer``'s and
``Reader``'s arguments).

Imports neither torch nor anything above ``zephon.config``: the job config composes it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from zephon.errors import invalid_option
from zephon.retention import MAX_KEEP

__all__ = ["DEFAULT_MEMORY_DIR", "MAX_MEMORY_REPLICAS", "TierConfig"]

#: where the memory tier keeps its checkpoints by default: a RAM disk that outlives the
#: training processes (it lasts until the node reboots)
DEFAULT_MEMORY_DIR = "/dev/shm/zephon"

#: peer copies of each node's memory checkpoint at most (each on another node)
MAX_MEMORY_REPLICAS = 8


@dataclass(kw_only=True, slots=True)
class TierConfig:
    """A node-local directory where saves commit first, uploaded in the background.

    ``local_dir``: a plain path on a node-local disk (``file://`` is stripped), never
    ``save_dir`` itself; None: the config only checks the two numbers. ``local_num_to_keep``:
    local checkpoints kept beyond those still waiting for their upload.
    ``max_pending_uploads``: a save waits while this many uploads are pending. ``save_dir``
    (a local path or a URL) is what ``local_dir`` must differ from (None: not compared).
    ``prefix`` names the options in messages: a config prefix (``trainer.checkpointing``,
    keys ``trainer.checkpointing.local_dir``) or an owner (``Writer``, ``Writer.local_dir``).

    ``memory_tier``: saves commit into host memory first (``memory_dir``, a RAM disk on each
    node), are copied to ``memory_replicas`` peer nodes and uploaded to save_dir in the
    background (docs/tiers.md, "The memory tier"); ``memory_num_to_keep`` memory checkpoints
    are kept beyond those still waiting for their upload. With both, ``local_dir`` is a
    durable tier behind host memory: each save is copied there after the peer copies and
    before the upload (docs/memory.md, "A local disk behind memory").

    ``dedup``: the tier's own copy stays plain files and its uploader stores the shard files
    in ``save_dir`` as content-addressed chunks against the newest checkpoint there
    (docs/dedup.md, "Layout", the tiers).
    """

    local_dir: str | None = None
    local_num_to_keep: int = 1
    max_pending_uploads: int = 2
    save_dir: str | None = None
    prefix: str = "trainer.checkpointing"
    memory_tier: bool = False
    memory_dir: str | None = None
    memory_num_to_keep: int = 1
    memory_replicas: int = 1
    dedup: bool = False

    def __post_init__(self) -> None:
        if self.local_dir is not None:
            self.local_dir = self._own_path(
                "local_dir", "a node-local directory", "a node-local disk (e.g. /local_nvme/ckpt)"
            )
        for key in ("local_num_to_keep", "max_pending_uploads", "memory_num_to_keep"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_KEEP:
                raise self._fail(key, f"use an integer from 1 to {MAX_KEEP}")
        self._check_memory_tier()
        if not isinstance(self.dedup, bool):
            raise self._fail("dedup", "use true or false")

    @property
    def enabled(self) -> bool:
        """Whether a save goes to a tier first (memory or a local directory)."""
        return self.memory_tier or self.local_dir is not None

    def _check_memory_tier(self) -> None:
        """``memory_tier`` a bool; ``memory_dir`` a local path of its own (default
        ``DEFAULT_MEMORY_DIR``); ``memory_replicas`` from 1 to ``MAX_MEMORY_REPLICAS``."""
        if not isinstance(self.memory_tier, bool):
            raise self._fail("memory_tier", "use true or false")
        replicas = self.memory_replicas
        if (
            isinstance(replicas, bool)
            or not isinstance(replicas, int)
            or not 1 <= replicas <= MAX_MEMORY_REPLICAS
        ):
            raise self._fail("memory_replicas", f"use an integer from 1 to {MAX_MEMORY_REPLICAS}")
        if self.memory_dir is None:
            if self.memory_tier:
                self.memory_dir = DEFAULT_MEMORY_DIR
        else:
            self.memory_dir = self._own_path(
                "memory_dir", "a directory in host memory", "a RAM disk (e.g. /dev/shm/zephon)"
            )
        if self.memory_tier and self.local_dir is not None:
            self._check_apart(self.memory_dir, self.local_dir)

    def _check_apart(self, memory_dir: Any, local_dir: str) -> None:
        """With both tiers, ``local_dir`` and ``memory_dir`` are directories apart: each tier
        prunes its own directory (and the memory tier clears what an earlier job left in
        it), so one inside the other would lose the other's checkpoints."""
        memory, local = os.path.realpath(memory_dir), os.path.realpath(local_dir)
        inside = local.startswith(memory + os.sep) or memory.startswith(local + os.sep)
        if memory == local or inside:
            raise self._fail(
                "local_dir",
                f"it overlaps memory_dir ({memory}); use a directory on a node-local disk "
                "apart from host memory",
            )

    def _own_path(self, key: str, what: str, where: str) -> str:
        """``key``'s value as a plain local path (``file://`` stripped), checked to be a
        directory of its own; a one-line error naming ``key`` for anything else."""
        path = getattr(self, key)
        if not isinstance(path, str) or not path.strip():
            raise self._fail(key, f"use {what}, or leave it unset")
        if "://" in path and not path.startswith("file://"):
            raise self._fail(
                key, f"use a plain path on {where}; remote storage belongs in save_dir"
            )
        if path.startswith("file://"):
            path = path[len("file://") :]
        self._check_its_own_directory(path, key)
        return path

    def _fail(self, key: str, allowed: str) -> Exception:
        return invalid_option(f"{self.prefix}.{key}", getattr(self, key), allowed)

    def _check_its_own_directory(self, local: Any, key: str) -> None:
        """``local_dir`` (``memory_dir``) must be a directory of its own: the tier keeps only
        its newest checkpoints, so if it were ``save_dir`` (directly or through a symlink) its
        pruning would delete save_dir's checkpoints; a file there cannot hold any."""
        if os.path.exists(local) and not os.path.isdir(local):
            raise self._fail(key, "it names a file; use a directory on a node-local disk")
        save_dir = self.save_dir
        if save_dir is None:
            return
        if save_dir.startswith("file://"):
            save_dir = save_dir[len("file://") :]
        elif "://" in save_dir:
            return  # remote save_dir: a local path is never the same place
        if os.path.realpath(local) == os.path.realpath(save_dir):
            raise self._fail(
                key,
                f"it is save_dir ({os.path.realpath(save_dir)}); use a separate directory on a "
                "node-local disk, uploaded to save_dir in the background",
            )
