"""Subcommands that handle tensors (export, demo); torch is imported only when they run."""

from __future__ import annotations


def register(add) -> None:
    """Nothing yet: export and demo arrive with the checkpoint manager."""
