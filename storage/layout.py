"""Names and paths of the checkpoint layout: ``<root>/<run>/save-<step>/`` and its marker.

A training job's checkpoints live under ``<root>/<run>/``; an inference job has no run name
and saves straight under ``<root>/`` (``run=None`` everywhere in this package).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from zephon.storage.errors import InvalidNameError

__all__ = [
    "MAX_STEP",
    "ATTEMPTS_DIR",
    "CORRUPT_PREFIX",
    "MARKER_NAME",
    "STEP_PREFIX",
    "validate_run",
    "validate_step",
    "validate_file_name",
    "step_dirname",
    "parse_step_dirname",
    "parse_number",
    "RunLayout",
]

#: a save id (and payload directory name): what one ``begin`` of a step is called
SAVE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: the run's directory of content-addressed chunks (deduplicated saves, ``storage/chunks.py``)
CHUNK_DIR = "_chunks"
MARKER_NAME = "_COMMIT"
#: ``save-<step>/_CORRUPT.<save_id>``: that save failed verification (reason and its manifest)
CORRUPT_PREFIX = "_CORRUPT."
#: ``<run>/_attempts/<epoch>.json``: one create-only record per attempt (job start) of a run
ATTEMPTS_DIR = "_attempts"
STEP_PREFIX = "save-"
_RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_STEP_DIR = re.compile(r"save-(0|[1-9][0-9]*)")
#: the largest step: what a catalog's BIGINT column holds
MAX_STEP = 2**63 - 1
# ASCII only: str.isdigit(), int() and the regex \d also take other scripts' digits ("٤" is 4)
_ASCII_DIGITS = re.compile(r"[0-9]+")
_RESERVED_PREFIXES = (MARKER_NAME,)


def validate_run(run: str | None) -> str | None:
    """Return ``run`` if it is a valid run name (or None for the inference layout), else raise."""
    if run is None:
        return None
    if not isinstance(run, str):
        raise InvalidNameError(
            f"run name must be a string, got {type(run).__name__} {run!r}", run=None
        )
    if (
        not _RUN_NAME.fullmatch(run)
        or run in {".", "..", ATTEMPTS_DIR, CHUNK_DIR}
        or _STEP_DIR.fullmatch(run)
    ):
        raise InvalidNameError(
            f"invalid run name {run!r}: use 1-128 characters from A-Z a-z 0-9 . _ - "
            f"(not '.', '..', {ATTEMPTS_DIR!r}, {CHUNK_DIR!r} or a step directory name like "
            "'save-5'), e.g. 'llama-7b.lr3e-4'",
            run=run if len(run) <= 200 else run[:200] + "...",
        )
    return run


def validate_step(step: int) -> int:
    """Return ``step`` if it is an int from 0 to ``MAX_STEP`` (bools refused), else raise."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        shown = repr(step) if len(repr(step)) <= 40 else repr(step)[:40] + "..."
        raise InvalidNameError(
            f"invalid step {shown}: a step is an integer from 0 to {MAX_STEP}, such as 0 or 1500"
        )
    return step


def validate_file_name(name: str) -> str:
    """A file's path relative to its checkpoint directory: ``a/b.bin``, no ``..``, no marker."""
    if (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or "\\" in name
        or any(ord(c) < 32 for c in name)
    ):
        raise InvalidNameError(
            f"invalid checkpoint file name {name!r}: use a relative path such as "
            "'model/shard-0.bin' (no leading '/', no backslashes, no control characters)",
            path=str(name),
        )
    parts = name.split("/")
    if any(p in {"", ".", ".."} for p in parts):
        raise InvalidNameError(
            f"invalid checkpoint file name {name!r}: empty, '.' and '..' path parts are "
            "not allowed",
            path=name,
        )
    if parts[0].startswith(_RESERVED_PREFIXES):
        raise InvalidNameError(
            f"invalid checkpoint file name {name!r}: names starting with {MARKER_NAME!r} are "
            "reserved for the commit marker",
            path=name,
        )
    return name


def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{validate_step(step)}"


def parse_number(text: object, maximum: int = MAX_STEP) -> int | None:
    """``text`` as a whole number from 0 to ``maximum`` if it is ASCII digits and nothing else
    (no sign, space, underscore or other script's digits, all of which ``int()`` takes), else
    None. Every step, epoch or rank read from a name or an argument is parsed here."""
    if not isinstance(text, str) or not _ASCII_DIGITS.fullmatch(text):
        return None
    if len(text.lstrip("0")) > len(str(maximum)):  # too large, and int() of it may be slow
        return None
    value = int(text)
    return value if value <= maximum else None


def parse_step_dirname(name: str) -> int | None:
    """The step of a ``save-<step>`` directory name, or None for anything else (a number
    beyond ``MAX_STEP`` included: no save can have written it)."""
    match = _STEP_DIR.fullmatch(name) if isinstance(name, str) else None
    return parse_number(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Where one run's files are: its directory (``run_path``, in the filesystem's own form,
    made by the run's ``RunStore`` from the store's root) and every path below it. A plain
    value, so the modules that act on a run (writer, reader, markers, leftovers) take it
    instead of the store."""

    run: str | None
    run_path: str

    def __post_init__(self) -> None:
        validate_run(self.run)

    def checkpoint_path(self, step: int) -> str:
        """The step directory ``save-<step>``."""
        return f"{self.run_path}/{step_dirname(step)}"

    def marker_path(self, step: int) -> str:
        """The step's commit marker."""
        return f"{self.checkpoint_path(step)}/{MARKER_NAME}"

    def payload_path(self, step: int, save_id: str) -> str:
        """The payload directory of one save of the step."""
        return f"{self.checkpoint_path(step)}/{save_id}"

    def chunk_path(self, name: str) -> str:
        """One chunk instance of the run (``_chunks/<sha256>.<save_id>``)."""
        return f"{self.run_path}/{CHUNK_DIR}/{name}"

    @property
    def chunk_dir(self) -> str:
        """The run's chunk directory."""
        return f"{self.run_path}/{CHUNK_DIR}"

    def record_path(self, step: int, key: str) -> str:
        """The ``_CORRUPT.<key>`` record condemning a save (or a damaged marker) of the step."""
        return f"{self.checkpoint_path(step)}/{CORRUPT_PREFIX}{key}"
