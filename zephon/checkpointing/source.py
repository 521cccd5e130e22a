"""Model tensors out of a checkpoint or an export, without the training job's classes:
for ``zephon export`` and for loading frozen parameters from ``source_checkpoint``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from zephon import dcp as zdcp
from zephon.checkpointing.files import DCP_SUBDIR, META_FILE, decode_json
from zephon.errors import ZephonError
from zephon.state_tree import join_state, tensor_keys
from zephon.storage import (
    CheckpointNotFoundError,
    CheckpointStore,
    RetryPolicy,
    parse_number,
    parse_step_dirname,
)

__all__ = [
    "INDEX_FILE",
    "load_frozen_from_source",
    "parse_checkpoint_url",
    "read_model_tensors",
    "read_source_tensors",
]

INDEX_FILE = "model.safetensors.index.json"
#: the fix when a source checkpoint is not there
_SOURCE_FIX = (
    "point model_stage_factory.source_checkpoint (zephon export --source) at the base model: a "
    ".safetensors file, a zephon export directory or a checkpoint <save_dir>/<run>/save-<step>"
)


def parse_checkpoint_url(url: str) -> tuple[str, str | None, int]:
    """``(save_dir, run or None, step)`` of a checkpoint directory URL.

    ``<save_dir>/<run>/save-<step>`` is taken as a training checkpoint; a URL whose parent has
    no run component that is a valid run name reads as ``<save_dir>/save-<step>``.
    """
    base, slash, last = url.rstrip("/").rpartition("/")
    step = parse_step_dirname(last)
    if step is None or not slash:
        raise ZephonError(
            f"{url[:300]!r} is not a checkpoint directory: expected <save_dir>/<run>/save-<step> "
            "or <save_dir>/save-<step>"
        )
    parent, _, run = base.rpartition("/")
    if parent and "://" not in run and run:
        return parent, run, step
    return base, None, step


def _flatten_model(tree: Any, key: str, stages: bool) -> dict[str, torch.Tensor]:
    if not stages:
        return dict(tree)
    return {f"{i}.{fqn}": t for i, part in tree.items() for fqn, t in part.items()}


def read_model_tensors(
    store: CheckpointStore, run: str | None, step: int, *, key: str = "model"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of model entry ``key`` in checkpoint ``(run, step)``, named as in the
    module's ``state_dict()`` (``<stage>.<name>`` for a list of stages), and the checkpoint's
    ``zephon.json``. Runs in this process alone, whatever torch.distributed is doing."""
    checkpoint = store.run(run).reader(step)
    meta = decode_json(checkpoint.read_bytes(META_FILE), f"{checkpoint.url}/{META_FILE}")
    kinds = meta.get("entries", {})
    if kinds.get(key) != "model":
        models = [k for k, kind in kinds.items() if kind == "model"]
        raise ZephonError(
            f"checkpoint {checkpoint.url} has no model entry {key!r} (model entries: "
            f"{', '.join(models) or 'none'}); pass one of those"
        )
    skeleton = meta["state"][key]
    reader = zdcp.ZephonStorageReader(store, run, step, subdir=DCP_SUBDIR, verify=True)
    metadata = reader.read_metadata()
    targets = {}
    for name in tensor_keys(skeleton):
        md = metadata.state_dict_metadata[name]
        targets[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    try:
        dcp.load(
            targets,
            storage_reader=reader,
            no_dist=True,
            planner=zdcp.ZephonLoadPlanner(where=checkpoint.url),
        )
    except CheckpointException as exc:
        raise zdcp.as_zephon_error(exc, where=checkpoint.url, local_failure=reader.failure) from exc
    tree = join_state(skeleton, targets)
    stages = bool(tree) and all(
        parse_number(k) is not None and isinstance(v, dict) for k, v in tree.items()
    )
    return _flatten_model(tree, key, stages), meta


def read_source_tensors(
    source: str,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors of a model source: a ``.safetensors`` file, a directory with
    ``model.safetensors.index.json`` (or one ``model.safetensors``), or a Zephon checkpoint
    directory URL. One that does not exist raises ``zephon.CheckpointNotFoundError`` naming
    it (for a checkpoint URL, caused by storage's own)."""
    from safetensors.torch import load_file

    if source.endswith(".safetensors"):
        if not os.path.isfile(source):
            raise CheckpointNotFoundError(
                f"source checkpoint {source!r} does not exist; {_SOURCE_FIX}", url=source
            )
        return load_file(source)
    if os.path.isdir(source):
        index = os.path.join(source, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as handle:
                files = sorted(set(json.load(handle)["weight_map"].values()))
            tensors: dict[str, torch.Tensor] = {}
            for name in files:
                tensors.update(load_file(os.path.join(source, name)))
            return tensors
        single = os.path.join(source, "model.safetensors")
        if os.path.exists(single):
            return load_file(single)
        if parse_step_dirname(source.rstrip("/").rsplit("/", 1)[-1]) is None:
            raise ZephonError(
                f"source checkpoint {source!r} holds no model.safetensors or {INDEX_FILE}; "
                "point it at a Zephon export or checkpoint directory"
            )
    save_dir, run, step = parse_checkpoint_url(source)
    try:
        store = CheckpointStore(save_dir, storage_options, retry=retry)
        tensors, _ = read_model_tensors(store, run, step)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"source checkpoint {source} cannot be loaded ({exc}); {_SOURCE_FIX}",
            url=source,
            run=run,
            step=step,
        ) from exc
    return tensors


def load_frozen_from_source(
    modules: Sequence[nn.Module],
    source: str,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> int:
    """Copy every parameter that does not require grad from ``source`` into ``modules``.

    Names are matched as ``zephon export`` writes them: the module's own names for one stage,
    ``<stage>.<name>`` for several. A missing name or another shape raises naming it. Returns
    the number of parameters loaded.
    """
    tensors = read_source_tensors(source, storage_options, retry)
    loaded, missing, shapes = 0, [], []
    with torch.no_grad():
        for index, module in enumerate(modules):
            for name, param in module.named_parameters():
                if param.requires_grad:
                    continue
                key = name if len(modules) == 1 else f"{index}.{name}"
                value = tensors.get(key)
                if value is None:
                    missing.append(key)
                elif tuple(value.shape) != tuple(param.shape):
                    shapes.append(f"{key} (source {list(value.shape)}, model {list(param.shape)})")
                else:
                    param.copy_(value)
                    loaded += 1
    if missing or shapes:
        parts = []
        if missing:
            parts.append(f"missing from the source: {', '.join(missing[:10])}")
        if shapes:
            parts.append(f"other shapes: {', '.join(shapes[:10])}")
        raise ZephonError(
            f"cannot load the frozen parameters from source checkpoint {source}: "
            f"{'; '.join(parts)}; point model_stage_factory.source_checkpoint at the base model "
            "this job was started from"
        )
    return loaded
