"""A checkpoint writer run as a separate process by the crash and race tests.

Usage: python -m tests.storage.writer_child '<json args>'

It prints one line per event (``begun``, ``wrote <i>``, ``committing``, ``committed``,
``conflict``) so the parent can kill it at a chosen moment. With ``kill_at`` it SIGKILLs itself
at an exact point of the commit: ``before-marker`` (payload durable, no marker yet),
``marker-in-flight`` (POSIX: temp marker written, not yet linked; object stores: request about
to be sent) or ``after-marker`` (marker created, writer not yet returned).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from zephon.storage import CheckpointStore, CommitConflictError, WriteAbortedError
from zephon.storage.backends import ObjectStoreBackend, PosixBackend

#: the backend classes whose marker create the kill points wrap (S3 and GCS share theirs)
MARKER_CLASSES = (PosixBackend, ObjectStoreBackend)


def say(event: str) -> None:
    print(event, flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_point(kill_at: str | None) -> None:
    if kill_at is None:
        return
    if kill_at == "before-marker":
        for cls in MARKER_CLASSES:
            cls.create_exclusive = lambda self, path, data: die()
        return
    if kill_at == "marker-in-flight":
        real_link = os.link

        def link_then_die(src, dst, *a, **k):  # temp marker is on disk, the link never happens
            die()
            return real_link(src, dst, *a, **k)

        os.link = link_then_die
        ObjectStoreBackend.create_exclusive = lambda self, path, data: die()
        return
    if kill_at == "after-marker":
        for cls in MARKER_CLASSES:
            real = cls.create_exclusive

            def create_then_die(self, path, data, _real=real):
                _real(self, path, data)
                die()

            cls.create_exclusive = create_then_die
        return
    raise SystemExit(f"unknown kill_at {kill_at!r}")


def wait_for(path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.005)


def main() -> None:
    args = json.loads(sys.argv[1])
    install_kill_point(args.get("kill_at"))
    store = CheckpointStore(args["url"], args.get("storage_options") or {})
    tag = args.get("tag", "w")
    sync = args.get("sync_dir")
    writer = store.run(args["run"]).begin(args["step"])
    say("begun")
    if sync:
        open(os.path.join(sync, f"begun-{tag}"), "w").close()
        wait_for(os.path.join(sync, "write"))
    size = args.get("file_size", 4096)
    for i in range(args.get("files", 8)):
        writer.write_bytes(f"{tag}/part-{i:03d}.bin", bytes([i % 256]) * size + tag.encode())
        say(f"wrote {i}")
    if sync:
        open(os.path.join(sync, f"written-{tag}"), "w").close()
        wait_for(os.path.join(sync, "commit"))
    say("committing")
    try:
        writer.commit(metadata={"tag": tag})
    except (CommitConflictError, WriteAbortedError) as exc:
        say(f"conflict {type(exc).__name__}")
        writer.abort()
        return
    say("committed")


if __name__ == "__main__":
    main()
