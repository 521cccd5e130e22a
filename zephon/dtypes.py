"""torch dtypes by name: the one table that turns a dtype into the name stored in a checkpoint
(JSON state, DCP metadata) and back. Decoding accepts only names of real dtypes, so a name
read from a checkpoint can never reach ``getattr(torch, ...)``."""

from __future__ import annotations

import torch

from zephon.errors import UsageError

__all__ = ["DTYPES", "dtype_from_name", "dtype_name"]

#: every dtype, by the name torch prints without its ``torch.`` prefix
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (getattr(torch, n, None) for n in dir(torch))
    if isinstance(d, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The stored name of ``dtype``; ``zephon.UsageError`` (a ``ValueError``) for one without
    a stable name, which a state to save cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise UsageError(
            f"dtype {dtype} has no stable name, so it cannot be saved: store it as a string, "
            "or use one of zephon.dtypes.DTYPES"
        )
    return name


def dtype_from_name(name: object) -> torch.dtype:
    """The dtype a stored name means; ``ValueError`` for anything that is not one (a name read
    from a checkpoint: every caller turns it into ``storage.CorruptCheckpointError``)."""
    try:
        return DTYPES[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {str(name)[:60]!r}") from None
