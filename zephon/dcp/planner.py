"""``ZephonLoadPlanner``: DCP's default load planner with a clear mismatch error and the
restricted unpickler (``zephon.dcp.untrusted.restricted_load``) for non-tensor items."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from zephon.dcp.untrusted import restricted_load

__all__ = ["ZephonLoadPlanner"]

_SHOWN = 10


class ZephonLoadPlanner(DefaultLoadPlanner):
    """Like ``DefaultLoadPlanner``, but

    - before planning, compares the state dict with the checkpoint and raises one
      ``StateDictMismatchError`` naming every missing key and every tensor whose saved shape
      differs (DCP stops at the first, inside an exception that lists tracebacks per rank);
    - loads non-tensor items with ``restricted_load`` (``torch.load(weights_only=True)``),
      which rebuilds only tensors and plain containers and numbers, so a tampered checkpoint
      cannot run code.

    ``where`` (the checkpoint's URL) goes into the error message.
    """

    def __init__(self, *, allow_partial_load: bool = False, where: str | None = None) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.where = where

    def create_local_plan(self) -> LoadPlan:
        self._check_state_dict()
        return super().create_local_plan()

    def _check_state_dict(self) -> None:
        from zephon.dcp.errors import StateDictMismatchError

        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
        missing = [] if self.allow_partial_load else [k for k in self.state_dict if k not in saved]
        shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        kinds = []
        for key, value in self.state_dict.items():
            md = saved.get(key)
            if md is None:
                continue
            is_tensor = isinstance(value, torch.Tensor)
            if isinstance(md, TensorStorageMetadata) != is_tensor:
                kinds.append(
                    f"{key} (a {'tensor' if is_tensor else type(value).__name__} here, "
                    f"{'a tensor' if isinstance(md, TensorStorageMetadata) else 'not a tensor'} "
                    "in the checkpoint)"
                )
            elif is_tensor and tuple(md.size) != tuple(value.size()):
                shapes[key] = (tuple(md.size), tuple(value.size()))
        if not (missing or shapes or kinds):
            return
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} key(s) are not in the checkpoint: "
                f"{', '.join(missing[:_SHOWN])}{' ...' if len(missing) > _SHOWN else ''}"
            )
        if shapes:
            listed = [f"{k} (checkpoint {list(a)}, here {list(b)})" for k, (a, b) in shapes.items()]
            parts.append(
                f"{len(shapes)} tensor(s) have another shape: {', '.join(listed[:_SHOWN])}"
                f"{' ...' if len(listed) > _SHOWN else ''}"
            )
        if kinds:
            parts.append(f"{len(kinds)} value(s) have another kind: {', '.join(kinds[:_SHOWN])}")
        where = f"checkpoint {self.where}" if self.where else "the checkpoint"
        fix = "build the model and optimizer with the configuration the checkpoint was saved with"
        if missing:
            fix += ", or load with allow_partial_load=True to leave missing keys untouched"
        raise StateDictMismatchError(
            f"cannot load {where} into this state dict: {'; '.join(parts)}; {fix}",
            missing=missing,
            shape_mismatches=shapes,
            url=self.where,
        )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = restricted_load(value.getbuffer(), key=read_item.dest_index.fqn, where=self.where)
        self.load_object(read_item, obj)

    def load_object(self, read_item: ReadItem, obj: Any) -> None:
        """Put ``obj``, a non-tensor item already rebuilt by ``restricted_load`` (by
        ``ZephonStorageReader``), where ``read_item`` says."""
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
