"""The JSON files the manager keeps beside the DCP shards in a checkpoint directory.

``zephon.json`` (written by rank 0) holds the step, the run, the job's ``total_steps``, the
world size, what each state entry is, and the JSON skeleton of all non-tensor state.
``ranks/<rank>.json`` holds each rank's own state: its random number generators and anything
passed as ``rank_state``.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import torch

from zephon.storage import CorruptCheckpointError, JsonDocumentError, parse_json

__all__ = [
    "DCP_SUBDIR",
    "META_FILE",
    "META_VERSION",
    "capture_rng",
    "decode_json",
    "encode_json",
    "rank_file",
    "restore_rng",
]

META_FILE = "zephon.json"
META_VERSION = 1
DCP_SUBDIR = "dcp"


def rank_file(rank: int) -> str:
    return f"ranks/{rank}.json"


def encode_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


def decode_json(data: bytes, where: str) -> Any:
    """A checkpoint's JSON document (``where``: its URL, for the message);
    ``CorruptCheckpointError`` if it is not one Zephon reads (not JSON, nested too deep)."""
    try:
        return parse_json(data)
    except JsonDocumentError as exc:
        raise CorruptCheckpointError(
            f"{where} is damaged ({exc.reason}); resume from an earlier checkpoint",
            url=where,
            problems=[f"{where}: {exc.reason}"],
        ) from None


def capture_rng() -> dict[str, Any]:
    """This process's random number generator states, as JSON values."""
    state: dict[str, Any] = {
        "python": _python_state(random.getstate()),
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    except ImportError:  # numpy is optional
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss_value = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss_value))


def _python_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]
