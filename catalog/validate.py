"""Argument checks shared by the ``Catalog`` methods, run before any database work."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from catalog.errors import InvalidValueError
from catalog.models import CheckpointState, RunKind, RunStatus

_RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def run_name(name: str) -> str:
    """A run name is 1-128 characters of ``[A-Za-z0-9._-]``, and not ``.`` or ``..``."""
    if not isinstance(name, str) or not _RUN_NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidValueError(
            "run name", name, "expected 1-128 characters of [A-Za-z0-9._-], not '.' or '..'"
        )
    return name


def step(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidValueError("step", value, "expected an integer >= 0")
    return value


def optional_step(argument: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidValueError(argument, value, "expected a step (an integer >= 0), or None")
    return value


def epoch(value: int, *, minimum: int = 0) -> int:
    """An attempt's fencing token: an integer >= ``minimum`` (0 means unfenced)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidValueError("epoch", value, f"expected an integer >= {minimum}")
    return value


def token(argument: str, value: str) -> str:
    """Save and attempt ids: 1-64 characters of ``[A-Za-z0-9_-]`` (a uuid hex fits)."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise InvalidValueError(argument, value, "expected 1-64 characters of [A-Za-z0-9_-]")
    return value


def host(value: str) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= 255:
        raise InvalidValueError("host", value, "expected a host name of 1-255 characters")
    return value


def pid(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise InvalidValueError("pid", value, "expected a process id (an integer >= 0)")
    return value


def aware(argument: str, value: datetime) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidValueError(argument, value, "expected a timezone-aware datetime")
    return value


def duration(argument: str, value: timedelta) -> timedelta:
    if not isinstance(value, timedelta) or value < timedelta(0):
        raise InvalidValueError(argument, value, "expected a duration >= 0")
    return value


def optional_count(argument: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise InvalidValueError(argument, value, "expected an integer >= 0, or null")
    return value


def storage_url(argument: str, url: str) -> str:
    """Storage URLs are stored and printed, so they must not carry credentials."""
    if not isinstance(url, str) or not url:
        raise InvalidValueError(argument, url, "expected a non-empty storage URL or path")
    if "://" in url and urlsplit(url).password is not None:
        raise InvalidValueError(
            argument,
            re.sub(r"//([^/@:]*):[^/@]*@", r"//\1:***@", url),
            "credentials must not be part of a storage URL; pass them as storage options",
        )
    return url


def kind(value: str) -> str:
    return _member("kind", value, RunKind)


def status(value: str) -> str:
    return _member("status", value, RunStatus)


def states(values: object) -> list[str] | None:
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    return [_member("state", v, CheckpointState) for v in values]  # type: ignore[union-attr]


def _member(argument: str, value: str, enum: type) -> str:
    allowed = [member.value for member in enum]
    if value not in allowed:
        raise InvalidValueError(argument, value, f"expected one of {', '.join(allowed)}")
    return str(value)
