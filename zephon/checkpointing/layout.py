"""What a checkpoint holds, from the objects a job passes to ``save``/``load_latest``.

The job passes one mapping, e.g. ``{"model": model, "optimizer": opt, "lr_scheduler": sched,
"data": pipeline_stateful, "task": task, "metrics": {...}}``. Each entry is one of:

- a model stage (``nn.Module``) or several (a list of them): tensors via torch DCP's
  ``get_model_state_dict`` (DTensor/FSDP aware), keyed ``model/<fqn>`` or ``model/<i>/<fqn>``;
- an optimizer: via ``get_optimizer_state_dict`` against the entries' model stages, so its state
  is keyed by parameter name, not by position;
- anything with ``state_dict()``/``load_state_dict()`` (LR scheduler, task, data pipeline,
  metrics, tracker): its state dict;
- any other value (numbers, strings, lists, dicts, tensors): stored as is and handed back by
  ``load_latest``.

Tensors go to DCP; everything else to JSON (``zephon.state_tree``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from zephon.errors import ZephonError

__all__ = ["IN_PLACE", "PER_RANK", "Entry", "StateLayout"]

MODEL, OPTIMIZER, STATEFUL, VALUE = "model", "optimizer", "stateful", "value"
#: entries whose tensors are loaded in place and resharded by DCP, shared by all ranks
IN_PLACE = frozenset({MODEL, OPTIMIZER})
#: entries each rank saves and gets back on its own
PER_RANK = frozenset({STATEFUL, VALUE})


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    kind: str
    value: Any


class StateLayout:
    """The classified entries of one state mapping, and how to read and apply their state."""

    def __init__(self, state: Mapping[str, Any], *, trainable_only: bool = False) -> None:
        if not isinstance(state, Mapping) or not state:
            raise ZephonError(
                "save/load_latest need a non-empty mapping of what to checkpoint, e.g. "
                "{'model': model, 'optimizer': optimizer, 'data': pipeline}"
            )
        self.trainable_only = trainable_only
        self.entries: list[Entry] = []
        for key, value in state.items():
            if not isinstance(key, str) or not key or "/" in key:
                raise ZephonError(f"state key {key!r} must be a non-empty string without '/'")
            self.entries.append(Entry(key, self._kind(value), value))
        self._stages = [m for e in self.entries if e.kind == MODEL for m in self._modules(e)]

    @staticmethod
    def _kind(value: Any) -> str:
        if isinstance(value, nn.Module):
            return MODEL
        if isinstance(value, Sequence) and value and all(isinstance(v, nn.Module) for v in value):
            return MODEL
        if isinstance(value, torch.optim.Optimizer):
            return OPTIMIZER
        if _is_stateful(value):
            return STATEFUL
        return VALUE

    @staticmethod
    def _modules(entry: Entry) -> list[nn.Module]:
        return [entry.value] if isinstance(entry.value, nn.Module) else list(entry.value)

    def _optimizer_model(self) -> nn.Module | None:
        if not self._stages:
            return None
        return self._stages[0] if len(self._stages) == 1 else nn.ModuleList(self._stages)

    def _options(self, **extra: Any) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=self.trainable_only, **extra)

    # -- reading state -----------------------------------------------------------------------

    def state_tree(self, kinds: frozenset[str] | set[str] | None = None) -> dict[str, Any]:
        """Every entry's current state (or only entries of ``kinds``): what ``save`` writes,
        and on load the tensors that torch DCP loads into, in place."""
        tree: dict[str, Any] = {}
        for entry in self.entries:
            if kinds is not None and entry.kind not in kinds:
                continue
            if entry.kind == MODEL:
                modules = self._modules(entry)
                parts = [get_model_state_dict(m, options=self._options()) for m in modules]
                tree[entry.key] = (
                    parts[0]
                    if isinstance(entry.value, nn.Module)
                    else {str(i): part for i, part in enumerate(parts)}
                )
            elif entry.kind == OPTIMIZER:
                model = self._optimizer_model()
                if model is None:
                    tree[entry.key] = entry.value.state_dict()
                else:
                    tree[entry.key] = get_optimizer_state_dict(
                        model, entry.value, options=self._options()
                    )
            elif entry.kind == STATEFUL:
                tree[entry.key] = entry.value.state_dict()
            else:
                tree[entry.key] = entry.value
        return tree

    def load_targets(self) -> dict[str, Any]:
        """The state tree of the entries whose tensors are loaded in place (models and
        optimizers); the others take whatever the checkpoint holds."""
        return self.state_tree(IN_PLACE)

    # -- applying loaded state ------------------------------------------------------------------

    def apply(self, loaded: Mapping[str, Any]) -> dict[str, Any]:
        """Load each entry's state from ``loaded``; returns the plain values (kind VALUE)."""
        missing = [e.key for e in self.entries if e.key not in loaded]
        if missing:
            raise ZephonError(
                f"the checkpoint holds no {', '.join(repr(k) for k in missing)} (it has "
                f"{', '.join(repr(k) for k in loaded)}); pass the same state keys that were saved"
            )
        values: dict[str, Any] = {}
        # Models first: the optimizer's state is matched to their parameters.
        for entry in sorted(self.entries, key=lambda e: e.kind != MODEL):
            state = loaded[entry.key]
            if entry.kind == MODEL:
                modules = self._modules(entry)
                parts = (
                    [state]
                    if isinstance(entry.value, nn.Module)
                    else [state[str(i)] for i in range(len(modules))]
                )
                for module, part in zip(modules, parts, strict=True):
                    set_model_state_dict(
                        module, part, options=self._options(strict=not self.trainable_only)
                    )
            elif entry.kind == OPTIMIZER:
                model = self._optimizer_model()
                if model is None:
                    entry.value.load_state_dict(state)
                else:
                    set_optimizer_state_dict(model, entry.value, state, options=self._options())
            elif entry.kind == STATEFUL:
                entry.value.load_state_dict(state)
            else:
                values[entry.key] = state
        return values

    @property
    def model_keys(self) -> list[str]:
        return [e.key for e in self.entries if e.kind == MODEL]

    def kinds(self) -> dict[str, str]:
        return {e.key: e.kind for e in self.entries}
