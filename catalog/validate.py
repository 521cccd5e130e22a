"""Argument checks shared by the ``Catalog`` methods, run before any database work.

Two kinds of rule live here:

- **Names.** A run name is what storage accepts as a run directory, character for character:
  1-128 of ``[A-Za-z0-9._-]``, not ``.`` or ``..``, not ``_attempts`` (storage keeps a run's
  attempt records there) and not a step directory name (``save-<step>``, e.g. ``save-5``),
  which a training layout ``<root>/<run>/save-<step>/`` would confuse with an inference run's
  checkpoints. The catalog may not import storage, so the rule is written out here again; a
  test states it with examples and another holds the two layers to the same answers.
- **Bounds.** Every integer must fit the column that stores it (``INTEGER``: 32 bits,
  ``BIGINT``: 64 bits, signed on both backends), so an out-of-range value is refused here with
  the argument, the value and the range, instead of as a driver overflow (PostgreSQL) or a
  silently stored value (SQLite) later.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from zephon.catalog.errors import InvalidValueError
from zephon.catalog.models import CheckpointState, ReplicaState, ReplicaTier, RunKind, RunStatus

#: the largest value of a ``BIGINT`` column (steps, epochs, sizes, milestones)
MAX_BIGINT = 2**63 - 1
#: the largest value of an ``INTEGER`` column (``num_to_keep``, ``file_count``, ``pid``)
MAX_INT = 2**31 - 1
#: the longest duration accepted (grace, lease, event age); ``now - duration`` must not leave
#: the range of ``datetime``
MAX_DURATION = timedelta(days=365 * 1000)
#: storage's directory of a run's attempt records, ``<run>/_attempts/``
RESERVED_RUN_NAMES = frozenset({".", "..", "_attempts"})
RUN_NAME_RULE = (
    "expected 1-128 characters of [A-Za-z0-9._-], not '.', '..', '_attempts' or a step "
    "directory name like 'save-5'"
)

#: the phases a save's ``timings`` may name, each in seconds (docs/catalog.md, Timings)
TIMING_PHASES = (
    "stall_s",
    "stage_s",
    "write_s",
    "commit_s",
    "total_s",
    "local_s",
    "upload_s",
    "memory_s",
    "replicate_s",
)

_RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_STEP_DIR = re.compile(r"save-(0|[1-9][0-9]*)")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_run_name(name: object) -> bool:
    """Whether ``name`` is a valid run name (the rule in the module docstring)."""
    return (
        isinstance(name, str)
        and _RUN_NAME.fullmatch(name) is not None
        and name not in RESERVED_RUN_NAMES
        and _STEP_DIR.fullmatch(name) is None
    )


def run_name(name: str) -> str:
    if not is_run_name(name):
        raise InvalidValueError("run name", name, RUN_NAME_RULE)
    return name


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(argument: str, value: int, *, minimum: int, maximum: int = MAX_BIGINT) -> int:
    """An ``int`` (not a bool) in ``[minimum, maximum]``."""
    if not _is_int(value) or not minimum <= value <= maximum:
        raise InvalidValueError(argument, value, f"expected an integer from {minimum} to {maximum}")
    return value


def optional_integer(
    argument: str, value: int | None, *, minimum: int, maximum: int = MAX_BIGINT
) -> int | None:
    """``None``, or an ``int`` in ``[minimum, maximum]``."""
    if value is not None and (not _is_int(value) or not minimum <= value <= maximum):
        raise InvalidValueError(
            argument, value, f"expected an integer from {minimum} to {maximum}, or None"
        )
    return value


def step(value: int, argument: str = "step") -> int:
    return integer(argument, value, minimum=0)


def optional_step(argument: str, value: int | None) -> int | None:
    return optional_integer(argument, value, minimum=0)


def epoch(value: int, *, minimum: int = 0) -> int:
    """An attempt's fencing token: an integer >= ``minimum`` (0 means unfenced)."""
    return integer("epoch", value, minimum=minimum)


def total_steps(value: int | None) -> int | None:
    return optional_integer("total_steps", value, minimum=1)


def num_to_keep(value: int | None) -> int | None:
    return optional_integer("num_to_keep", value, minimum=1, maximum=MAX_INT)


def keep_every_steps(value: int | None) -> int | None:
    return optional_integer("keep_every_steps", value, minimum=1)


def byte_count(value: int | None) -> int | None:
    return optional_integer("bytes", value, minimum=0)


def file_count(value: int | None) -> int | None:
    return optional_integer("file_count", value, minimum=0, maximum=MAX_INT)


def pid(value: int) -> int:
    return integer("pid", value, minimum=0, maximum=MAX_INT)


def limit(value: int) -> int:
    return integer("limit", value, minimum=1)


def token(argument: str, value: str) -> str:
    """Save and attempt ids: 1-64 characters of ``[A-Za-z0-9_-]`` (a uuid hex fits)."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise InvalidValueError(argument, value, "expected 1-64 characters of [A-Za-z0-9_-]")
    return value


def text(argument: str, value: str, *, maximum: int | None = None, empty: bool = False) -> str:
    """A string for a text column: no NUL character (PostgreSQL refuses them, SQLite would
    store them), at most ``maximum`` characters, non-empty unless ``empty``."""
    low = 0 if empty else 1
    if not isinstance(value, str) or not low <= len(value) <= (maximum or len(value)):
        length = f"{low}-{maximum}" if maximum else f"at least {low}"
        raise InvalidValueError(argument, value, f"expected a string of {length} characters")
    if "\x00" in value:
        raise InvalidValueError(argument, value, "expected a string without NUL characters")
    return value


def host(value: str) -> str:
    return text("host", value, maximum=255)


def reason(argument: str, value: str, *, empty: bool = False) -> str:
    """Free text explaining a state (a failure, a corruption); NUL characters, which only
    arrive inside exception messages, are replaced rather than refused."""
    if not isinstance(value, str) or not (empty or value):
        wanted = "a string" if empty else "a non-empty string"
        raise InvalidValueError(argument, value, f"expected {wanted}")
    return value.replace("\x00", "\\x00")


def json_document(argument: str, value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``None`` or a dict that both backends store alike: JSON-serialisable, no NaN or
    infinity (PostgreSQL's JSONB refuses them), no NUL character (JSONB refuses ``\\u0000``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidValueError(argument, value, "expected a JSON object (dict) or None")
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidValueError(
            argument, value, f"expected a JSON object of JSON values ({exc})"
        ) from None
    if "\\u0000" in encoded:
        raise InvalidValueError(argument, value, "expected JSON without NUL characters")
    return value


def aware(argument: str, value: datetime) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidValueError(argument, value, "expected a timezone-aware datetime")
    return value


def duration(argument: str, value: timedelta) -> timedelta:
    if not isinstance(value, timedelta) or not timedelta(0) <= value <= MAX_DURATION:
        raise InvalidValueError(
            argument, value, f"expected a duration from 0 to {MAX_DURATION.days} days"
        )
    return value


def positive_duration(argument: str, value: timedelta) -> timedelta:
    if not isinstance(value, timedelta) or not timedelta(0) < value <= MAX_DURATION:
        raise InvalidValueError(
            argument, value, f"expected a duration above 0 and up to {MAX_DURATION.days} days"
        )
    return value


def storage_url(argument: str, url: str) -> str:
    """Storage URLs are stored and printed, so they must not carry credentials."""
    if not isinstance(url, str) or not url:
        raise InvalidValueError(argument, url, "expected a non-empty storage URL or path")
    if "://" in url and _password(url) is not None:
        raise InvalidValueError(
            argument,
            re.sub(r"//([^/@:]*):[^/@]*@", r"//\1:***@", url),
            "credentials must not be part of a storage URL; pass them as storage options",
        )
    return text(argument, url)


def _password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:  # e.g. an invalid port or IPv6 literal: not a URL with credentials
        return None


def kind(value: str) -> str:
    return _member("kind", value, RunKind)


def status(value: str) -> str:
    return _member("status", value, RunStatus)


def states(values: object) -> list[str] | None:
    return _states(values, CheckpointState)


def _states(values: object, enum: type) -> list[str] | None:
    """A state filter: None (every state), one state, or an iterable of states of ``enum``."""
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidValueError("states", values, "expected a state or a list of states") from None
    return [_member("state", v, enum) for v in items]


def _member(argument: str, value: str, enum: type) -> str:
    allowed = [member.value for member in enum]
    if not isinstance(value, str) or value not in allowed:
        raise InvalidValueError(argument, value, f"expected one of {', '.join(allowed)}")
    return str(value)


def timings(value: Mapping[str, float] | None) -> dict[str, float] | None:
    """``None``, or a mapping of known phase names (``TIMING_PHASES``) to finite seconds
    >= 0, returned as a plain dict of floats. An unknown phase is refused naming it and the
    known ones, so a typo never becomes a column nobody reads."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidValueError("timings", value, "expected a mapping of phase name to seconds")
    checked: dict[str, float] = {}
    for phase, seconds in value.items():
        if phase not in TIMING_PHASES:
            raise InvalidValueError(
                "timings phase", phase, f"expected one of {', '.join(TIMING_PHASES)}"
            )
        if (
            not isinstance(seconds, int | float)
            or isinstance(seconds, bool)
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise InvalidValueError(
                f"timings {phase}", seconds, "expected a finite number of seconds >= 0"
            )
        checked[phase] = float(seconds)
    return checked


def checkpoint_facts(
    size: int | None,
    files: int | None,
    manifest_checksum: str | None,
    metadata: dict[str, Any] | None,
    stored: int | None = None,
) -> dict[str, Any]:
    """What a committed checkpoint's row records about its files (``bytes``, ``file_count``,
    ``manifest_checksum``, ``meta``: the ``metadata``, ``stored_bytes``), checked, as column
    values."""
    byte_count(size)
    optional_integer("stored_bytes", stored, minimum=0)
    file_count(files)
    if manifest_checksum is not None:
        text("manifest_checksum", manifest_checksum, maximum=128)
    json_document("metadata", metadata)
    return {
        "bytes": size,
        "file_count": files,
        "manifest_checksum": manifest_checksum,
        "meta": metadata,
        "stored_bytes": stored,
    }


def tier(value: str) -> str:
    return _member("tier", value, ReplicaTier)


def replica_host(tier_: str, value: str) -> str:
    """A local replica names its host (1-255 characters); a ``save_dir`` one has host ``""``
    (shared storage belongs to no node)."""
    if tier_ == ReplicaTier.SAVE_DIR:
        if value != "":
            raise InvalidValueError(
                "host", value, "expected '' for a save_dir replica (shared storage has no host)"
            )
        return value
    return host(value)


def replica_states(values: object) -> list[str] | None:
    return _states(values, ReplicaState)
