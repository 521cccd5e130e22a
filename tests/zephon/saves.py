"""Test helpers that save through the real save path (``zephon.saving.Save``) as an attempt
does, and that stop it at exact points (after the marker, before it) as a crash would."""

from __future__ import annotations

from catalog import Catalog
from zephon.attempts import Attempt, register
from zephon.locations import RunLocation
from zephon.saving import Save


def start(
    location: RunLocation, catalog: Catalog | None = None, resumed_from: int | None = None
) -> Attempt:
    """A new attempt of the run (a job start) resuming from ``resumed_from``."""
    lineage = location.runstore.lineage()
    return register(location, catalog, lineage=lineage, resumed_from=resumed_from)


def save_step(attempt: Attempt, step: int, catalog: Catalog | None = None, files=None):
    """A complete save; returns its manifest."""
    with Save.begin(attempt, step, catalog=catalog) as writer:
        writer.write_many(files or {"state.json": b'{"step": %d}' % step, "w.bin": b"x" * 64})
        return writer.commit()


def crash_after_marker(attempt: Attempt, catalog: Catalog | None, step: int):
    """A save that dies between writing the marker and updating the catalog."""
    save = Save.begin(attempt, step, catalog=catalog)
    save.writer.write_bytes("w.bin", b"y")
    return save.writer.commit()


def crash_before_marker(attempt: Attempt, catalog: Catalog | None, step: int) -> Save:
    """A save that dies with its files written and no marker."""
    save = Save.begin(attempt, step, catalog=catalog)
    save.writer.write_bytes("w.bin", b"partial")
    return save
