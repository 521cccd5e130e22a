"""Attempts and lineage: which attempt (job start) of a run is current, and which checkpoints
belong to the history it continues.

Every start of a job that writes checkpoints claims the next **epoch** of its run by creating
``<run>/_attempts/<epoch>.json`` exclusively, with the same create-only write that publishes a
commit marker (POSIX ``link``, S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``). Of two
attempts racing for one epoch exactly one wins; the newest record is the current attempt, and
every write of an older one is refused once it re-checks (``FencedOutError``).

The claim comes first and fences older attempts; only then does the attempt choose where it
resumes, and record it, again create-only, as ``<epoch>.resume.json``. Choosing before the claim
would let an older attempt, still current, delete or supersede the chosen step between the
choice and the claim. Until it decides, an attempt abandons nothing.

An attempt resumes from some step ``r`` (or from nothing). Checkpoints of older epochs with a
step above ``r`` belong to a history it abandoned, however complete they are. Each record keeps,
for every older epoch, the highest step still in the current history (its *cutoff*: the smallest
``r`` of any later attempt), so a reader learns the whole lineage from the newest record alone:
one listing and one GET. Cutoffs never decrease with the epoch, so they are stored as ranges.

Epoch 0 is the era before any fenced attempt (and unfenced writers): on a run with no record,
epoch-0 checkpoints are the history; once an attempt exists they are judged like any other
older epoch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from zephon.storage.backend import create_settled, list_files, make_dirs, read_small
from zephon.storage.errors import CorruptCheckpointError, FencedOutError
from zephon.storage.jsondoc import parse_json
from zephon.storage.layout import ATTEMPTS_DIR
from zephon.storage.location import Location

__all__ = [
    "AttemptRecord",
    "Fence",
    "Lineage",
    "claim_attempt",
    "decide_resume",
    "decided",
    "newer_epochs",
    "read_lineage",
    "read_records",
]

_RECORD_NAME = re.compile(r"([0-9]{10,})\.json")  # ASCII: \d takes other scripts' digits
_DECISION_NAME = re.compile(r"([0-9]{10,})\.resume\.json")
_VERSION = 1


def record_name(epoch: int) -> str:
    return f"{epoch:010d}.json"


def decision_name(epoch: int) -> str:
    return f"{epoch:010d}.resume.json"


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One attempt of a run: its epoch, who it is, and where it resumed from.

    ``cutoffs`` are ``(up_to_epoch, cutoff)`` pairs in ascending order: a checkpoint of epoch
    ``e`` (older than this one) is in this attempt's history iff its step is at most the cutoff
    of the first pair with ``up_to_epoch >= e`` (no pair: no limit). A cutoff of -1 means
    "nothing of that epoch". ``decided`` is False between the claim and the resume decision:
    ``resumed_from`` means nothing yet, and the cutoffs are those of the lineage it claimed
    under.
    """

    run: str | None
    epoch: int
    attempt_id: str
    host: str
    pid: int
    started_at: str
    resumed_from: int | None
    cutoffs: tuple[tuple[int, int], ...] = ()
    decided: bool = True

    def describe(self) -> str:
        """``epoch 5 (host h1, pid 4242, started 2026-...)`` for messages."""
        return f"epoch {self.epoch} (host {self.host}, pid {self.pid}, started {self.started_at})"

    def cutoff(self, epoch: int) -> int | None:
        """Highest step of ``epoch`` in this attempt's history; None means no limit."""
        if epoch >= self.epoch:
            return None
        for up_to, cutoff in self.cutoffs:
            if epoch <= up_to:
                return cutoff
        return None  # an epoch no decided later attempt has judged yet

    def to_json(self) -> bytes:
        body = {
            "format_version": _VERSION,
            "run": self.run,
            "epoch": self.epoch,
            "attempt_id": self.attempt_id,
            "host": self.host,
            "pid": self.pid,
            "started_at": self.started_at,
            "resumed_from": self.resumed_from,
            "cutoffs": [list(pair) for pair in self.cutoffs],
            "decided": self.decided,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str, epoch: int) -> AttemptRecord:
        try:
            body = parse_json(data)
            if body["format_version"] > _VERSION:
                raise ValueError(f"format_version {body['format_version']} is newer")
            record = cls(
                run=body["run"],
                epoch=int(body["epoch"]),
                attempt_id=str(body["attempt_id"]),
                host=str(body.get("host", "?")),
                pid=int(body.get("pid", 0)),
                started_at=str(body.get("started_at", "")),
                resumed_from=None if body["resumed_from"] is None else int(body["resumed_from"]),
                cutoffs=tuple((int(a), int(b)) for a, b in body["cutoffs"]),
                decided=bool(body.get("decided", True)),
            )
            if record.epoch != epoch:
                raise ValueError(f"it says epoch {record.epoch}")
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(
                f"attempt record {where} is damaged ({type(exc).__name__}: {exc}); the run's "
                "lineage cannot be read: restore or delete that file (every checkpoint of its "
                "epoch then counts as unregistered)",
                path=where,
                problems=[f"{where}: {exc}"],
            ) from None
        return record


@dataclass(frozen=True, slots=True)
class Lineage:
    """The run's history as its newest attempt record defines it (``current``; None when no
    fenced attempt ever started, and then only epoch-0 checkpoints count)."""

    current: AttemptRecord | None

    @property
    def epoch(self) -> int:
        """The current epoch (0 before any fenced attempt)."""
        return self.current.epoch if self.current is not None else 0

    def admits(self, epoch: int, step: int) -> bool:
        """Whether a checkpoint of ``epoch`` at ``step`` belongs to the current history."""
        return self.why_not(epoch, step) is None

    def why_not(self, epoch: int, step: int) -> str | None:
        """None if admitted, else why not (for messages and the catalog)."""
        current = self.current
        if current is None:
            return None if epoch == 0 else f"epoch {epoch} was never registered"
        if epoch > current.epoch:
            return f"epoch {epoch} was never registered (the newest is {current.epoch})"
        cutoff = current.cutoff(epoch)
        if cutoff is not None and step > cutoff:
            return (
                f"abandoned: a later attempt resumed from "
                f"{'nothing' if cutoff < 0 else f'step {cutoff}'}, so step {step} of epoch "
                f"{epoch} is not in the current history"
            )
        return None

    def claim(
        self,
        run: str | None,
        epoch: int,
        *,
        attempt_id: str | None = None,
        host: str | None = None,
        pid: int | None = None,
    ) -> AttemptRecord:
        """The undecided record of a new attempt ``epoch``: it judges older epochs as this
        lineage does until it decides where it resumes (``decided``)."""
        return AttemptRecord(
            run=run,
            epoch=epoch,
            attempt_id=attempt_id or uuid.uuid4().hex,
            host=host or socket.gethostname(),
            pid=os.getpid() if pid is None else pid,
            started_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
            resumed_from=None,
            cutoffs=self.current.cutoffs if self.current is not None else (),
            decided=False,
        )

    def successor(self, run: str | None, epoch: int, resumed_from: int | None) -> AttemptRecord:
        """A new attempt ``epoch`` claimed and decided at once (resuming from
        ``resumed_from``), as ``decided(claim(...), resumed_from)``."""
        return decided(self.claim(run, epoch), resumed_from)

    def __bool__(self) -> bool:
        return self.current is not None


def decided(record: AttemptRecord, resumed_from: int | None) -> AttemptRecord:
    """``record`` (undecided) once it resumes from ``resumed_from`` (None: from nothing):
    every older epoch's cutoff is lowered to ``resumed_from``."""
    limit = -1 if resumed_from is None else resumed_from
    pairs = [(up_to, min(c, limit)) for up_to, c in record.cutoffs]
    pairs.append((record.epoch - 1, limit))
    merged: list[tuple[int, int]] = []
    for up_to, cutoff in pairs:
        if merged and merged[-1][1] == cutoff:
            merged[-1] = (up_to, cutoff)
        else:
            merged.append((up_to, cutoff))
    return dataclasses.replace(
        record, resumed_from=resumed_from, cutoffs=tuple(merged), decided=True
    )


@dataclass(frozen=True, slots=True)
class Fence:
    """What a fenced writer carries: its attempt record (the token) and the lineage that
    record defines. Storage checks it at ``begin`` and immediately before the marker."""

    record: AttemptRecord

    @property
    def epoch(self) -> int:
        return self.record.epoch

    @property
    def attempt_id(self) -> str:
        return self.record.attempt_id

    @property
    def lineage(self) -> Lineage:
        return Lineage(self.record)


def attempts_path(location: Location, run_path: str) -> str:
    return f"{run_path}/{ATTEMPTS_DIR}"


def _epochs(location: Location, directory: str) -> tuple[list[int], set[int]]:
    """The epochs claimed (ascending) and those that decided, from one listing."""
    claimed, decided_epochs = [], set()
    for listed in list_files(location, directory):
        name = listed.path.rsplit("/", 1)[-1]
        if match := _RECORD_NAME.fullmatch(name):
            claimed.append(int(match.group(1)))
        elif match := _DECISION_NAME.fullmatch(name):
            decided_epochs.add(int(match.group(1)))
    return sorted(claimed), decided_epochs


def _read_record(location: Location, directory: str, epoch: int, decided_: bool) -> AttemptRecord:
    path = f"{directory}/{decision_name(epoch) if decided_ else record_name(epoch)}"
    return AttemptRecord.from_json(
        read_small(location, path), where=location.display(path), epoch=epoch
    )


def read_lineage(location: Location, run_path: str) -> Lineage:
    """The run's lineage: one listing of its attempt records and one read of the newest."""
    directory = attempts_path(location, run_path)
    claimed, decided_epochs = _epochs(location, directory)
    if not claimed:
        return Lineage(None)
    newest = claimed[-1]
    return Lineage(_read_record(location, directory, newest, newest in decided_epochs))


def read_records(location: Location, run_path: str) -> list[AttemptRecord]:
    """Every attempt record of the run, oldest first (one listing, one read per record)."""
    directory = attempts_path(location, run_path)
    claimed, decided_epochs = _epochs(location, directory)
    return [_read_record(location, directory, e, e in decided_epochs) for e in claimed]


def newer_epochs(location: Location, run_path: str, epoch: int) -> AttemptRecord | None:
    """The newest attempt record if one is newer than ``epoch`` (the fence re-check: one
    listing), else None."""
    directory = attempts_path(location, run_path)
    claimed, _ = _epochs(location, directory)
    if not claimed or claimed[-1] <= epoch:
        return None
    try:
        return _read_record(location, directory, claimed[-1], False)
    except (CorruptCheckpointError, FileNotFoundError):
        return AttemptRecord(None, claimed[-1], "?", "?", 0, "?", None)


def claim_attempt(
    location: Location,
    run_path: str,
    run: str | None,
    *,
    after: Lineage,
    min_epoch: int = 1,
    attempt_id: str | None = None,
) -> AttemptRecord:
    """Create the (undecided) record of a new attempt, the epoch after ``after`` (or
    ``min_epoch`` if higher), exclusively. If another attempt registered since ``after`` was
    read, the create fails and ``FencedOutError`` names it: read the lineage again."""
    epoch = max(after.epoch + 1, min_epoch)
    record = after.claim(run, epoch, attempt_id=attempt_id)
    _create(location, run_path, run, record_name(epoch), record, epoch)
    return record


def decide_resume(
    location: Location, run_path: str, record: AttemptRecord, resumed_from: int | None
) -> AttemptRecord:
    """Record where the attempt ``record`` resumes (create-only ``<epoch>.resume.json``) and
    return its decided record. Refused with ``FencedOutError`` if a newer attempt claimed
    the run meanwhile; deciding the same again returns the existing decision."""
    newer = newer_epochs(location, run_path, record.epoch)
    if newer is not None:
        raise FencedOutError(
            f"attempt epoch {record.epoch} of {location.display(run_path)} is no longer "
            f"current: {newer.describe()} took over before it chose where to resume; stop",
            epoch=record.epoch,
            current=newer,
            url=location.display(run_path),
            run=record.run,
        )
    final = decided(record, resumed_from)
    name = decision_name(record.epoch)
    try:
        _create(location, run_path, record.run, name, final, record.epoch)
    except FencedOutError:
        existing = _read_record(location, attempts_path(location, run_path), record.epoch, True)
        if existing.resumed_from != resumed_from:
            raise
        return existing
    return final


def _create(
    location: Location,
    run_path: str,
    run: str | None,
    name: str,
    record: AttemptRecord,
    epoch: int,
) -> None:
    directory = attempts_path(location, run_path)
    path = f"{directory}/{name}"
    make_dirs(location, directory)
    try:
        # The record is this attempt's own if it holds these very bytes (its attempt id
        # and start time): a create whose reply was lost succeeded.
        won = create_settled(location, path, record.to_json()).created
    except FileExistsError:
        won = False
    if not won:
        holder = newer_epochs(location, run_path, epoch - 1)
        raise FencedOutError(
            f"attempt epoch {epoch} of {location.display(run_path)} was registered by "
            f"another start first ({holder.describe() if holder else 'unknown'}); decide "
            "the resume point again on the new lineage",
            epoch=epoch,
            current=holder,
            url=location.display(run_path),
            run=run,
        ) from None
