"""The local tier's own config: ``local_dir``, ``local_num_to_keep`` and
``max_pending_uploads``, checked in one place whichever entry point takes them (the manager's
``trainer.checkpointing`` keys, ``zephon.dcp.Writer``'s and ``Reader``'s arguments).

Imports neither torch nor anything above ``zephon.config``: the job config composes it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from zephon.errors import invalid_option
from zephon.retention import MAX_KEEP

__all__ = ["TierConfig"]


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
    """

    local_dir: str | None = None
    local_num_to_keep: int = 1
    max_pending_uploads: int = 2
    save_dir: str | None = None
    prefix: str = "trainer.checkpointing"

    def __post_init__(self) -> None:
        local = self.local_dir
        if local is not None:
            if not isinstance(local, str) or not local.strip():
                raise self._fail("local_dir", "use a node-local directory, or leave it unset")
            if "://" in local and not local.startswith("file://"):
                raise self._fail(
                    "local_dir",
                    "use a plain path on a node-local disk (e.g. /local_nvme/ckpt); remote "
                    "storage belongs in save_dir",
                )
            if local.startswith("file://"):
                self.local_dir = local[len("file://") :]
            self._check_its_own_directory(self.local_dir)
        for key in ("local_num_to_keep", "max_pending_uploads"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_KEEP:
                raise self._fail(key, f"use an integer from 1 to {MAX_KEEP}")

    def _fail(self, key: str, allowed: str) -> Exception:
        return invalid_option(f"{self.prefix}.{key}", getattr(self, key), allowed)

    def _check_its_own_directory(self, local: Any) -> None:
        """``local_dir`` must be a directory of its own: the local tier keeps only its newest
        ``local_num_to_keep`` checkpoints, so if it were ``save_dir`` (directly or through a
        symlink) its pruning would delete save_dir's checkpoints; a file there cannot hold any."""
        if os.path.exists(local) and not os.path.isdir(local):
            raise self._fail("local_dir", "it names a file; use a directory on a node-local disk")
        save_dir = self.save_dir
        if save_dir is None:
            return
        if save_dir.startswith("file://"):
            save_dir = save_dir[len("file://") :]
        elif "://" in save_dir:
            return  # remote save_dir: a local path is never the same place
        if os.path.realpath(local) == os.path.realpath(save_dir):
            raise self._fail(
                "local_dir",
                f"it is save_dir ({os.path.realpath(save_dir)}); use a separate directory on a "
                "node-local disk, uploaded to save_dir in the background",
            )
