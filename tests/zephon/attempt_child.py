"""One attempt of a training job as a process of its own, driven one call at a time by
tests/zephon/test_two_attempts.py, so that a test can hold it at any exact point of the save
path while another attempt of the same run goes on.

    python -m tests.zephon.attempt_child

Reads one command per line on stdin and answers each with one JSON line on stdout:
``{"ok": true, "value": ...}``, or ``{"ok": false, "error": "<class>", "module": "<module>",
"message": "...", "current": "<the attempt a StaleAttemptError names>"}``. Every command goes
through the real save path (``zephon.saving.Save``, ``zephon.attempts``, ``zephon.latest``,
``zephon.gc``); nothing is patched.

    open <json>             {"catalog_url": URL or null, "url": storage URL,
                            "storage_options": {...}, "run": name}
    start none|latest|<s>   register an attempt resuming from nothing, from what find_latest
                            finds, or from step <s>
    claim                   the first half of a start: claim the next epoch (older attempts
                            are fenced out; nothing is abandoned yet)
    choose                  find_latest under the claimed lineage: the resume point, not yet
                            recorded (a start held between claiming and deciding)
    decide                  the second half: record what ``choose`` found as the resume point
    begin <step>            Save.begin of this attempt
    write <name> <content>  write one file of the save begun (content: the rest of the line)
    commit                  Save.commit(): the fence re-check, then the marker
    committed               Save.committed(): the catalog row
    fail                    Save.failed(): the save's own files go, its row fails
    retain <n>              the job's retention after a save: gc_run with this attempt's epoch
                            (the run's catalog policy, which must keep <n>), or, without a
                            catalog, retain_without_catalog keeping <n>
    latest                  find_latest
    forge_marker <step>     create the marker of the save begun, with this attempt's epoch,
                            exactly as writer.commit() would but without its fence re-check:
                            what a stale attempt can still do between its check and its marker
    close                   close the catalog and the store: the process is free for another
                            test's ``open``
    exit

Imports everything before reading the first command, so a process started ahead of time is
ready when a test takes it; after ``close`` one process serves the next test.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import sys
import traceback
from typing import Any

import psycopg  # noqa: F401 - imported ahead of the first command (see above)
import s3fs  # noqa: F401

from zephon.attempts import Attempt, claim, decide, register_resuming
from zephon.attempts import register as register_attempt
from zephon.catalog import Catalog
from zephon.gc import gc_run, retain_without_catalog
from zephon.latest import LatestCheckpoint, find_latest
from zephon.locations import RunLocation, run_location
from zephon.saving import Save
from zephon.storage import CheckpointStore, Fence, Manifest, create_exclusive
from zephon.storage.layout import MARKER_NAME


def described(latest: LatestCheckpoint | None) -> dict[str, Any] | None:
    if latest is None:
        return None
    return {
        "step": latest.step,
        "source": latest.source,
        "save_id": latest.manifest.save_id,
        "epoch": latest.manifest.epoch,
        "promoted": list(latest.promoted),
        "missing": list(latest.missing),
        "set_aside": [list(pair) for pair in latest.set_aside],
    }


class Job:
    """What one process of a job holds: its run, its attempt and the save under way."""

    def __init__(self) -> None:
        self.catalog: Catalog | None = None
        self.location: RunLocation | None = None
        self.attempt: Attempt | None = None
        self.save: Save | None = None
        self.fence: Fence | None = None
        self.chosen: LatestCheckpoint | None = None

    def open(self, text: str) -> dict[str, Any]:
        args = json.loads(text)
        options = args.get("storage_options") or {}
        if args.get("catalog_url"):
            self.catalog = Catalog(args["catalog_url"])
            self.location = run_location(self.catalog.get_run(args["run"]), options)
        else:
            store = CheckpointStore(args["url"], options)
            self.location = RunLocation(args["run"], store, args["run"])
        return {"pid": os.getpid(), "host": socket.gethostname()}

    def close(self, _: str) -> None:
        if self.catalog is not None:
            self.catalog.close()
        if self.location is not None:
            self.location.store.close()
        self.__init__()

    def start(self, how: str) -> dict[str, Any]:
        location, catalog = self.location, self.catalog
        found = None
        if how == "latest":

            def choose(lineage):
                latest = find_latest(location, catalog=catalog, lineage=lineage)
                return (latest.step if latest is not None else None), latest

            self.attempt, latest = register_resuming(location, catalog, choose)
            found = described(latest)
        else:
            resumed = None if how == "none" else int(how)
            lineage = location.runstore.lineage()
            self.attempt = register_attempt(
                location, catalog, lineage=lineage, resumed_from=resumed
            )
        return self._registered(found)

    def claim(self, _: str) -> dict[str, Any]:
        """The first half of a start: claim the next epoch (older attempts are fenced)."""
        lineage = self.location.runstore.lineage()
        self.fence = claim(self.location, self.catalog, lineage)
        return {"epoch": self.fence.epoch}

    def choose(self, _: str) -> dict[str, Any] | None:
        """Find the latest checkpoint under the claimed (undecided) lineage."""
        assert self.fence is not None, "claim first"
        self.chosen = find_latest(self.location, catalog=self.catalog, lineage=self.fence.lineage)
        return described(self.chosen)

    def decide(self, _: str) -> dict[str, Any]:
        """The second half: record the chosen step as the resume point."""
        step = self.chosen.step if self.chosen is not None else None
        self.attempt = decide(self.location, self.catalog, self.fence, step)
        return self._registered(described(self.chosen))

    def _registered(self, found: dict[str, Any] | None) -> dict[str, Any]:
        record = self.attempt.record
        return {
            "epoch": record.epoch,
            "resumed_from": record.resumed_from,
            "host": record.host,
            "pid": record.pid,
            "started_at": record.started_at,
            "latest": found,
        }

    def begin(self, step: str) -> str:
        self.save = Save.begin(self.attempt, int(step), catalog=self.catalog)
        return self.save.save_id

    def write(self, rest: str) -> dict[str, Any]:
        name, _, content = rest.partition(" ")
        entry = self.save.writer.write_bytes(name, content.encode())
        return {"name": entry.name, "size": entry.size}

    def commit(self, _: str) -> dict[str, Any]:
        manifest = self.save.commit()
        return {"step": manifest.step, "save_id": manifest.save_id, "epoch": manifest.epoch}

    def committed(self, _: str) -> str:
        return self.save.committed().save_id

    def fail(self, _: str) -> None:
        self.save.failed(RuntimeError("the test made this save fail"))

    def retain(self, num_to_keep: str) -> list[int]:
        keep = int(num_to_keep)
        location, catalog = self.location, self.catalog
        if catalog is not None:
            policy = catalog.get_run(location.name).num_to_keep
            if policy != keep:
                raise ValueError(f"the run keeps {policy} in the catalog, not {keep}")
            report = gc_run(catalog, location, orphans=False, epoch=self.attempt.epoch)
            return [item["step"] for item in report.deleted]
        return retain_without_catalog(
            location.store, location.storage_run, self.attempt.fence, keep
        )

    def latest(self, _: str) -> dict[str, Any] | None:
        return described(find_latest(self.location, catalog=self.catalog))

    def forge_marker(self, step: str) -> dict[str, Any]:
        """What ``writer.commit()`` does once its payload check passed, without the fence
        re-check; like a commit that returns, it leaves the manifest on the writer, so the
        save can go on to ``committed``."""
        writer = self.save.writer
        if writer.step != int(step):
            raise ValueError(f"the save begun is of step {writer.step}, not {step}")
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        manifest = Manifest(
            run=writer.run,
            step=writer.step,
            save_id=writer.save_id,
            files=tuple(writer.entries),
            epoch=writer.fence.epoch,
            attempt_id=writer.fence.attempt_id,
            payload=writer.save_id,
            writer={"host": socket.gethostname(), "pid": os.getpid()},
            created_at=now,
            committed_at=now,
        )
        location = self.location.store.location
        marker = f"{writer.path}/{MARKER_NAME}"
        create_exclusive(location, marker, manifest.to_json())
        writer.manifest = manifest
        return {"step": manifest.step, "save_id": manifest.save_id, "epoch": manifest.epoch}


COMMANDS = frozenset(
    {"open", "start", "claim", "choose", "decide", "begin", "write", "commit", "committed", "fail"}
    | {"retain", "latest", "forge_marker", "close"}
)


def answer(job: Job, line: str) -> dict[str, Any]:
    command, _, rest = line.partition(" ")
    if command not in COMMANDS:
        return {"ok": False, "error": "UnknownCommand", "module": __name__, "message": command}
    try:
        return {"ok": True, "value": getattr(job, command)(rest)}
    except Exception as exc:  # every failure is an answer: the test decides what it means
        current = getattr(exc, "current", None)
        return {
            "ok": False,
            "error": type(exc).__name__,
            "module": type(exc).__module__,
            "message": str(exc),
            "current": current.describe() if current is not None else None,
            "traceback": traceback.format_exc(limit=8),
        }


def main() -> int:
    job = Job()
    for raw in sys.stdin:
        line = raw.rstrip("\n")
        if line == "exit":
            print(json.dumps({"ok": True, "value": None}), flush=True)
            os._exit(0)  # nothing to finish: every answer is already written
        print(json.dumps(answer(job, line)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
