"""The checks a DCP load makes against the checkpoint's manifest and recorded CRC32Cs.

A checkpoint is untrusted input: before anything is read its JSON metadata must itself match
the manifest (``read_checked_file``) and place every slice inside a file the commit marker
lists, with the length its dtype and shape imply (``check_slices``); while reading, a slice
whose bytes differ from its recorded CRC32C or a file that ends early is reported by the
``CorruptCheckpointError`` built here, naming the file, the item and the fix.
"""

from __future__ import annotations

import math

from torch.distributed.checkpoint.metadata import Metadata

from zephon.dcp.metadata_codec import dtype_from_name
from zephon.dcp.read_plan import SliceRead
from zephon.dcp.untrusted import kind_problem
from zephon.storage import CheckpointReader, CorruptCheckpointError, encode_crc32c

__all__ = ["check_slices", "crc_mismatch_error", "read_checked_file", "short_read_error"]


def read_checked_file(reader: CheckpointReader, name: str) -> bytes:
    """One whole file, checked against the manifest's size and CRC32C: the copy the marker
    carries (no request), else one ranged read of the size the manifest records (plus one
    byte, so a longer file is caught), where a plain whole-file read costs object stores a
    HEAD first."""
    entry = reader.manifest.file(name)
    if entry is None:
        return reader.read_bytes(name)  # raises, naming the files the checkpoint has
    copy = reader.manifest.inline_bytes(name)  # checked against the entry's size and CRC32C
    if copy is not None:
        return copy
    data = reader.read_range(name, 0, entry.size + 1)
    reader.check(name, data)
    return data


def check_slices(
    metadata: Metadata,
    reader: CheckpointReader,
    *,
    run: str | None,
    step: int | None,
    metadata_path: str,
) -> None:
    """Raise ``CorruptCheckpointError`` if a slice of ``metadata`` is of the wrong kind, lies in
    a file the marker does not list or beyond its end, or has a length its shape contradicts."""
    sizes = {entry.name: entry.size for entry in reader.manifest.files}
    problems = []
    items = metadata.state_dict_metadata
    for index, where in (metadata.storage_data or {}).items():
        size = sizes.get(where.file)
        kind = kind_problem(index, where, items.get(index.fqn))
        if kind is not None:
            problems.append(kind)
        elif size is None:
            problems.append(f"{where.file}: not listed by the commit marker ({index.fqn})")
        elif where.offset + where.length > size:
            problems.append(
                f"{where.file}: {size} bytes, but {index.fqn} needs bytes "
                f"{where.offset}..{where.offset + where.length}"
            )
        elif where.encoding == "raw":
            expected = math.prod(where.shape or ()) * dtype_from_name(where.dtype or "").itemsize
            if expected != where.length:
                problems.append(
                    f"{where.file}: {index.fqn} has {where.length} bytes for shape "
                    f"{list(where.shape or ())} of {where.dtype} ({expected} expected)"
                )
    if problems:
        raise CorruptCheckpointError(
            f"DCP metadata of {reader.url} does not match its files: "
            f"{'; '.join(problems[:10])}; the checkpoint cannot be loaded: resume from an "
            "earlier checkpoint",
            url=reader.url,
            run=run,
            step=step,
            path=metadata_path,
            problems=problems,
        )


def crc_mismatch_error(
    r: SliceRead, crc: int, *, url: str, run: str | None, step: int | None
) -> CorruptCheckpointError:
    """The error for slice ``r`` of checkpoint ``url`` whose bytes have CRC32C ``crc``, not
    the one recorded at save time."""
    assert r.crc is not None
    index = r.req.storage_index
    sharded = index.offset is not None and any(index.offset)
    chunk = f" (the chunk at {list(index.offset or [])})" if sharded else ""
    problem = (
        f"{r.file}: crc32c of {index.fqn} is {encode_crc32c(crc)}, the checkpoint says "
        f"{encode_crc32c(r.crc)}"
    )
    return CorruptCheckpointError(
        f"{problem}{chunk}: bytes {r.start}..{r.start + r.length} of {r.file} in committed "
        f"checkpoint {url} changed after they were saved, so it cannot be loaded: "
        "resume from an earlier checkpoint (`zephon verify --deep` lists every damaged file)",
        url=url,
        run=run,
        step=step,
        path=r.file,
        problems=[problem],
    )


def short_read_error(
    name: str, wanted: int, got: int, *, url: str, run: str | None, step: int | None
) -> CorruptCheckpointError:
    """The error for file ``name`` of checkpoint ``url`` that ended at byte ``got`` where the
    manifest promised bytes up to ``wanted``."""
    return CorruptCheckpointError(
        f"{name} of committed checkpoint {url} is shorter than its manifest says "
        f"(needed bytes up to {wanted}, got {got}); the checkpoint is damaged: run `zephon "
        "verify` and resume from an earlier checkpoint",
        url=url,
        run=run,
        step=step,
        path=name,
        problems=[f"{name}: truncated"],
    )
