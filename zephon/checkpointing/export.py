"""Export a checkpoint's model as ``.safetensors`` files, sharded above a size, with the
``model.safetensors.index.json`` other tools (e.g. Hugging Face loaders) read."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zephon.checkpointing.source import INDEX_FILE, read_model_tensors, read_source_tensors
from zephon.errors import ZephonError
from zephon.storage import CheckpointStore

__all__ = ["ExportResult", "export_safetensors"]

DEFAULT_MAX_SHARD_BYTES = 5 << 30


@dataclass(frozen=True, slots=True)
class ExportResult:
    directory: str
    files: list[str]
    tensors: int
    total_bytes: int
    step: int


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _new_file_mode(path: str) -> int:
    """The permission bits a file created at ``path`` gets (0666 less the umask, or what the
    directory's default ACL says), found by creating it as ``open`` would."""
    with open(path, "wb"):
        pass
    return stat.S_IMODE(os.stat(path).st_mode)


def export_safetensors(
    store: CheckpointStore,
    run: str | None,
    step: int,
    out_dir: str,
    *,
    key: str = "model",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    source_checkpoint: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ExportResult:
    """Write model entry ``key`` of checkpoint ``(run, step)`` to ``out_dir``.

    One file ``model.safetensors`` when everything fits in ``max_shard_bytes``, else
    ``model-0000i-of-0000n.safetensors``; always ``model.safetensors.index.json``. A checkpoint
    that holds only trainable parameters is completed from ``source_checkpoint``.
    """
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ZephonError(f"max_shard_bytes = {max_shard_bytes} is invalid: use a size >= 1")
    tensors, meta = read_model_tensors(store, run, step, key=key)
    if meta.get("trainable_only"):
        if source_checkpoint is None:
            raise ZephonError(
                f"checkpoint {store.run(run).checkpoint_url(step)} holds only trainable "
                "parameters; pass the base model as source_checkpoint (zephon export --source) to "
                "export a complete model"
            )
        tensors = {**read_source_tensors(source_checkpoint, storage_options), **tensors}
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ZephonError(f"export directory {out_dir!r} is not empty; choose a new one")
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        if shards[-1] and size + _nbytes(tensor) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += _nbytes(tensor)
    count = len(shards)
    names = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    weight_map = {}
    for file_name, shard in zip(names, shards, strict=True):
        path = os.path.join(out_dir, file_name)
        mode = _new_file_mode(path)
        save_file(shard, path, metadata={"format": "pt"})
        # safetensors writes a private (0600) file; these are shared like any other output.
        os.chmod(path, mode)
        weight_map.update({tensor_name: file_name for tensor_name in shard})
    total = sum(_nbytes(t) for t in tensors.values())
    index = {
        "metadata": {"total_size": total, "zephon_checkpoint": store.run(run).checkpoint_url(step)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(os.path.join(out_dir, INDEX_FILE), "w") as handle:
        json.dump(index, handle, indent=2)
    return ExportResult(out_dir, names + [INDEX_FILE], len(tensors), total, step)
