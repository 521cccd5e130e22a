"""``PipelineStateful``: the pipeline behind torch's ``Stateful`` protocol.

torch.distributed.checkpoint (DCP), torchtitan and the Zephon checkpoint manager save any
object with ``state_dict()``/``load_state_dict()``. This adapter stores the pipeline's state as
one JSON string under one key: DCP keeps non-tensor values as opaque objects, and a string
survives its flattening of nested dicts and lists unchanged.

The only module of ``zephon.pipeline`` that imports torch at import time (``aggregate_torch``
imports it when a pipeline aggregates over torch.distributed).
"""

from __future__ import annotations

import json
from typing import Any

# Nothing below needs torch, but the adapter exists for torch's checkpointers: without torch,
# importing it (``zephon.PipelineStateful``) fails here, at once, as documented.
import torch  # noqa: F401

from zephon.errors import ArgumentTypeError
from zephon.pipeline.errors import PipelineStateError
from zephon.pipeline.pipeline import Pipeline
from zephon.storage import parse_json

__all__ = ["PipelineStateful"]

STATE_KEY = "zephon_pipeline_state"


class PipelineStateful:
    """Wraps a ``Pipeline`` so a torch checkpointer can save and load its position.

    ``state_dict()`` calls ``Pipeline.checkpoint()``, so in a distributed job every rank must
    call it at the same step (as DCP's ``save`` does); every rank gets the same merged state,
    which is what DCP expects of a value saved under one key on every rank.
    """

    def __init__(self, pipeline: Pipeline) -> None:
        if not isinstance(pipeline, Pipeline):
            raise ArgumentTypeError(
                f"PipelineStateful wraps a zephon.Pipeline, got {type(pipeline).__name__}: "
                "pass the Pipeline itself"
            )
        self.pipeline = pipeline

    def state_dict(self) -> dict[str, Any]:
        state = self.pipeline.checkpoint()
        return {STATE_KEY: json.dumps(state, separators=(",", ":"))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        text = state_dict.get(STATE_KEY) if isinstance(state_dict, dict) else None
        if not isinstance(text, (str, bytes)):
            raise PipelineStateError(
                f"load_state_dict needs {{{STATE_KEY!r}: <JSON string>}} as saved by "
                f"PipelineStateful.state_dict(), got {text!r}",
                field=STATE_KEY,
                value=text,
                expected="a JSON string",
            )
        try:
            state = parse_json(text)
        except ValueError as exc:
            raise PipelineStateError(
                f"{STATE_KEY} is {exc}; the checkpoint is damaged",
                field=STATE_KEY,
                value=text[:80],
                expected="a JSON string",
            ) from exc
        self.pipeline.restore(state)
