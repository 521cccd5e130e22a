"""Moved to ``zephon.collectives`` (both the manager and ``zephon.dcp`` use it); this name
stays for the callers that import it from here."""

from zephon.collectives import Collectives

__all__ = ["Collectives"]
