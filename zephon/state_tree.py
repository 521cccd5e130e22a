"""Splitting a nested state dict into tensors (for torch Distributed Checkpoint) and a JSON
skeleton (everything else), and joining them back: non-tensor state is never pickled.

The skeleton keeps the tree's shape; each tensor is replaced by ``{"__tensor__": key}`` where
``key`` is its path joined with ``/`` (``optimizer/state/fc.weight/exp_avg``). Tuples and dicts
with non-string keys are tagged so they come back as they went in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from zephon.dtypes import dtype_from_name, dtype_name
from zephon.errors import ZephonError
from zephon.storage import CorruptCheckpointError

__all__ = ["StateEncodingError", "join_state", "split_state", "tensor_keys"]

TENSOR = "__tensor__"
TUPLE = "__tuple__"
PAIRS = "__pairs__"
FLOAT = "__float__"
DTYPE = "__dtype__"
_TAGS = {TENSOR, TUPLE, PAIRS, FLOAT, DTYPE}
SEPARATOR = "/"


class StateEncodingError(ZephonError, TypeError):
    """A value in a state dict that Zephon cannot store without pickle."""


def _path(parts: tuple[str, ...]) -> str:
    return SEPARATOR.join(parts)


def split_state(tree: Any, prefix: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors by key, JSON-ready skeleton)`` of a nested state tree."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(tree, prefix, tensors)
    return tensors, skeleton


def _encode(value: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = _path(path)
        if key in tensors:
            raise StateEncodingError(
                f"two tensors map to the checkpoint key {key!r}; rename one of the state keys "
                f"(a key containing {SEPARATOR!r} can collide with a nested one)"
            )
        tensors[key] = value
        return {TENSOR: key}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {FLOAT: repr(value)}
    if isinstance(value, torch.dtype):
        return {DTYPE: dtype_name(value)}
    if isinstance(value, tuple | torch.Size):
        return {TUPLE: [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        plain = all(isinstance(k, str) for k in value) and not (
            len(value) == 1 and set(value) & _TAGS
        )
        if plain:
            return {k: _encode(v, (*path, k), tensors) for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if not (k is None or isinstance(k, bool | int | float | str)):
                raise StateEncodingError(
                    f"state key {k!r} at {_path(path) or '<root>'} is a {type(k).__name__}; "
                    "use str, int, float or bool keys"
                )
            pairs.append([_encode(k, path, {}), _encode(v, (*path, str(k)), tensors)])
        return {PAIRS: pairs}
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return _encode(item(), path, tensors)  # numpy scalars
    raise StateEncodingError(
        f"state value at {_path(path) or '<root>'} is a {type(value).__module__}."
        f"{type(value).__qualname__}: Zephon stores non-tensor state as JSON, never with pickle; "
        "have state_dict() return numbers, strings, lists, dicts or tensors instead"
    )


def join_state(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The tree that ``split_state`` took apart, with the given tensors put back."""
    if isinstance(skeleton, list):
        return [join_state(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if len(skeleton) == 1:
        ((tag, inner),) = skeleton.items()
        if tag == TENSOR:
            if inner not in tensors:
                raise ZephonError(f"the checkpoint has no tensor {inner!r} that its state names")
            return tensors[inner]
        if tag == TUPLE:
            return tuple(join_state(v, tensors) for v in inner)
        if tag == PAIRS:
            return {join_state(k, tensors): join_state(v, tensors) for k, v in inner}
        if tag == FLOAT:
            return float(inner)
        if tag == DTYPE:
            try:
                return dtype_from_name(inner)
            except ValueError as exc:
                raise CorruptCheckpointError(
                    f"the checkpoint's state names {exc}; it was not written by Zephon or is "
                    "damaged: resume from an earlier checkpoint",
                    problems=[str(exc)],
                ) from None
    return {k: join_state(v, tensors) for k, v in skeleton.items()}


def tensor_keys(skeleton: Any) -> list[str]:
    """Every tensor key a skeleton refers to."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if len(node) == 1 and TENSOR in node:
                found.append(node[TENSOR])
                return
            for v in node.values():
                walk(v)

    walk(skeleton)
    return found
