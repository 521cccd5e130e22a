"""Kill points for the dedup chaos processes (tests/zephon/dedup/chaos.py): each makes the
process SIGKILL itself at one exact moment of a deduplicated save or of a chunk sweep.

A kill point is ``<name>@<n>``: die the ``n``-th time (1-based) the process reaches the point
``name``. The points:

``chunk``         a chunk instance uploaded and acknowledged, before the save's next request:
                  a save cut among its chunk uploads
``before-marker`` every chunk of the save acknowledged, its marker not created: between the
                  chunk uploads and the marker
``after-marker``  the marker created, the catalog not told, retention not run
``before-sweep``  a retention pass deleted checkpoints (their markers first) and is about to
                  sweep their chunks: between marker deletion and the chunk sweep (a gc
                  process's own pass reaches it too, also when it deleted nothing)
``mid-sweep``     a sweep removing unreferenced chunks: half of them removed, then killed

They wrap the library's own functions in this process only (the child processes install
them before they start); nothing of the library is changed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

KILL_POINTS = ("chunk", "before-marker", "after-marker", "before-sweep", "mid-sweep")
#: the points a saver can reach (its own retention sweeps too) and those a gc pass reaches
SAVER_POINTS = KILL_POINTS
GC_POINTS = ("before-sweep", "mid-sweep")

_lock = threading.Lock()


def die(point: str) -> None:
    """Say where, then SIGKILL this process (no cleanup, no flush of anything else)."""
    sys.stdout.write(f"killing at {point}\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(spec: str | None) -> None:
    """Install the kill point ``<name>@<n>`` (None: none)."""
    if not spec:
        return
    name, _, nth = spec.partition("@")
    count = int(nth or 1)
    if name not in KILL_POINTS:
        raise SystemExit(f"unknown kill point {name!r}; one of {', '.join(KILL_POINTS)}")
    seen = [0]

    def reached() -> bool:
        with _lock:
            seen[0] += 1
            return seen[0] >= count

    if name == "chunk":
        from zephon.storage import chunked_file

        real_place = chunked_file.SaveChunks.place

        def place(self, view, crc):
            uploads = len(self._own)
            ref = real_place(self, view, crc)
            if len(self._own) > uploads and reached():  # this call uploaded an instance
                die(spec)
            return ref

        chunked_file.SaveChunks.place = place
    elif name in ("before-marker", "after-marker"):
        from zephon.storage import writer

        real_create = writer.CheckpointWriter._create_marker

        def create_marker(self, data):
            if name == "before-marker" and self._chunks is not None and reached():
                die(spec)
            outcome = real_create(self, data)
            if name == "after-marker" and self._chunks is not None and reached():
                die(spec)
            return outcome

        writer.CheckpointWriter._create_marker = create_marker
    elif name == "before-sweep":
        from zephon import gc

        real_sweep = gc.sweep_chunks_of

        def sweep_chunks_of(*args, **kwargs):
            if reached():
                die(spec)
            return real_sweep(*args, **kwargs)

        gc.sweep_chunks_of = sweep_chunks_of
    elif name == "mid-sweep":
        from zephon.storage import chunk_sweep

        real_remove = chunk_sweep.remove_files

        def remove_files(location, paths):
            paths = list(paths)
            if paths and reached():
                real_remove(location, paths[: len(paths) // 2])
                die(spec)
            return real_remove(location, paths)

        chunk_sweep.remove_files = remove_files
