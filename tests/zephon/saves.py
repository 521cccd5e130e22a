"""Test helpers that save through the real save path (``zephon.saving.Save``) as an attempt
does, and that stop it at exact points (after the marker, before it) as a crash would."""

from __future__ import annotations

import os

from zephon.attempts import Attempt, register
from zephon.catalog import Catalog
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


def largest_tensor_slice(metadata_json: bytes, where: str):
    """The largest tensor slice (file relative to the payload directory, offset and length of
    the tensor's elements) named by a DCP save's ``dcp_metadata.json``. A load checks the bytes
    it reads: a tensor's elements, not the zip around them in its ``torch.save`` blob (the
    manifest's file CRC32C covers those: ``zephon verify --deep``), so damage meant to be met by
    a load goes there."""
    from zephon.dcp import decode_metadata

    metadata = decode_metadata(metadata_json, where=where)
    slices = [w for w in metadata.storage_data.values() if w.encoding == "raw"]
    return max(slices, key=lambda w: w.length)


def flip_a_tensor_byte(payload: str, subdir: str = "dcp") -> str:
    """Flip the middle byte of the largest tensor slice of the DCP save whose payload directory
    is the local path ``payload``; returns the slice's file (relative to ``payload``)."""
    with open(os.path.join(payload, subdir, "dcp_metadata.json"), "rb") as handle:
        where = largest_tensor_slice(handle.read(), payload)
    with open(os.path.join(payload, where.file), "r+b") as handle:
        handle.seek(where.offset + where.length // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    return where.file
