"""The commit marker's exclusive create, as older callers reach it.

How a marker is created is its backend's ``create_exclusive`` (``storage.backends``; call it
as ``storage.backend.create_exclusive(location, path, data)``). ``marker_protocol_for`` is
kept for callers written against the earlier per-protocol classes; it delegates.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsspec.spec import AbstractFileSystem

from storage.backends import Backend
from storage.location import Location

__all__ = ["MarkerProtocol", "marker_protocol_for"]


@dataclass(frozen=True, slots=True)
class MarkerProtocol:
    """A location's marker create: ``create`` makes the file or raises ``FileExistsError``."""

    backend: Backend

    @property
    def exclusive(self) -> bool:
        """True when the backend itself refuses a second create: a race has one winner."""
        return self.backend.exclusive_create

    def create(self, fs: AbstractFileSystem, path: str, data: bytes) -> None:
        """Create ``path`` holding ``data``; ``fs`` must be the location's filesystem."""
        self.backend.create_exclusive(path, data)


def marker_protocol_for(location: Location) -> MarkerProtocol:
    """The marker create of ``location`` (its backend's ``create_exclusive``)."""
    return MarkerProtocol(location.backend)
