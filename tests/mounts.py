"""Real read-only and full filesystems for tests of what Zephon says about them.

Tests run as root here and in CI, and chmod does not stop root: a read-only bind mount and a
small tmpfs do. ``Mounts`` mounts them and unmounts everything it mounted when the test ends
(the ``mounts`` fixture in tests/conftest.py), whatever the test left open.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


class MountUnavailable(Exception):
    """This process cannot mount (not root, or no mount command)."""


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise MountUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


class Mounts:
    """Mount points made by one test, unmounted (newest first) by ``unmount_all``."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise MountUnavailable("mounting a read-only or small filesystem needs root")
        self._mounted: list[Path] = []

    def read_only(self, path: Path) -> Path:
        """Make ``path`` (a directory or a file) read-only in place, for root too."""
        _run("mount", "--bind", str(path), str(path))
        self._mounted.append(path)
        _run("mount", "-o", "remount,bind,ro", str(path))
        return path

    def small_disk(self, path: Path, size: str = "1m") -> Path:
        """A fresh empty tmpfs of ``size`` at ``path`` (made if missing)."""
        path.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
        self._mounted.append(path)
        return path

    def unmount_all(self) -> None:
        # Lazily: a file still open (a pooled connection, a leaked handle) must not keep the
        # mount, and with it the test's tmp_path, alive after the test.
        while self._mounted:
            subprocess.run(["umount", "-l", str(self._mounted.pop())], check=False)


def fill(directory: Path) -> None:
    """Fill the filesystem holding ``directory`` to the last byte."""
    with open(directory / "filler", "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError:
            pass
        try:  # the last partial block
            while True:
                filler.write(b"\0")
        except OSError:
            pass
