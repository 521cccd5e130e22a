"""torchtitan's llama3 debug model on the CPU, for the tests: run under ``torchrun`` as
torchtitan's own entry point (``torchtitan.train.main``) with this module as the config registry:

    torchrun --standalone --nproc_per_node 2 torchtitan_worker.py \
        --module torchtitan_worker --config zephon_debug [torchtitan flags ...]

Environment: ``TT_ASSETS`` (a folder with ``tok/`` and ``data/``, made by ``make_assets``),
``TT_LOSSES`` (rank 0 appends ``step loss`` lines), ``TT_STEPS``, ``TT_KILL_IN_SAVE_OF`` (rank 0
SIGKILLs itself between the files and the marker of that step's save), ``TT_KILL_AT_STEP``
(rank 0 SIGKILLs itself right after logging that step's loss).

CPU shims, all in this test worker and none in Zephon, since torchtitan 0.3.0 targets GPUs:

- the device type is forced to ``cpu`` (torchtitan falls back to ``cuda`` without one);
- ``torchtitan.distributed.minimal_async_ep.kernels`` is a stub: torchtitan imports triton
  through it for every model without declaring the dependency; the stub raises if an
  expert-parallel kernel is ever called (the dense debug model calls none);
- the memory monitor reports zeros (``torch.cpu`` has no memory statistics);
- SDPA replaces FlexAttention (no CPU backward), ``partial_dtensor`` with a replicate degree of
  2 replaces FSDP sharding, and the timeout adjustment after the first step, which needs a
  ``barrier(device_ids=...)`` and ``dist.set_timeout`` that gloo on this torch lacks, is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import types

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"


def _stub_triton_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def fail(*args, **kwargs):
            raise RuntimeError(f"{attr} needs triton (expert parallelism), absent on the CPU")

        return fail

    stub.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules.setdefault(name, stub)


_stub_triton_kernels()

import torchtitan.components.metrics as _metrics  # noqa: E402
import torchtitan.distributed.utils as _dist_utils  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    ScaledDotProductAttention,
)
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402


class _CPUMemoryMonitor:
    device_name = "cpu"
    device_capacity_gib = 0.0

    def __init__(self, *args, **kwargs) -> None:
        pass

    def get_peak_stats(self):
        return _metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


_metrics.DeviceMemoryMonitor = _CPUMemoryMonitor
_dist_utils.set_pg_timeouts = lambda *args, **kwargs: None


def _record_losses() -> None:
    path = os.environ.get("TT_LOSSES")
    kill_at = int(os.environ.get("TT_KILL_AT_STEP") or 0)
    real_log = _metrics.MetricsProcessor.log

    def log(self, step, global_avg_loss, *args, **kwargs):
        real_log(self, step, global_avg_loss, *args, **kwargs)
        if path and torch.distributed.get_rank() == 0:
            with open(path, "a") as out:
                out.write(f"{step} {float(global_avg_loss)!r}\n")
        if step == kill_at and torch.distributed.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    _metrics.MetricsProcessor.log = log


def _kill_in_save() -> None:
    step = int(os.environ.get("TT_KILL_IN_SAVE_OF") or 0)
    if not step:
        return
    from zephon import storage

    real_commit = storage.CheckpointWriter.commit

    def commit(self, *args, **kwargs):
        if self.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_commit(self, *args, **kwargs)

    storage.CheckpointWriter.commit = commit


def zephon_debug():
    """llama3's debug model, small enough for two CPU ranks: seq_len 64, batch 2 per rank."""
    assets = os.environ["TT_ASSETS"]
    cfg = llama3_debugmodel()
    for _, _, parent, attr in list(cfg.model_spec.model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    cfg.hf_assets_path = os.path.join(assets, "tok")
    cfg.dataloader.dataset_path = os.path.join(assets, "data")
    cfg.training.seq_len = 64
    cfg.training.local_batch_size = 2
    cfg.training.steps = int(os.environ.get("TT_STEPS", "8"))
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.parallelism.data_parallel_shard_degree = 1
    cfg.parallelism.data_parallel_replicate_degree = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validator.enable = False
    cfg.activation_checkpoint = None
    cfg.debug.seed = 0
    cfg.debug.deterministic = True
    cfg.debug.enable_structured_logging = False
    cfg.checkpoint.enable = True
    cfg.checkpoint.interval = 2
    return cfg


def make_assets(folder: str) -> None:
    """A character-level tokenizer (tokenizer.json + tokenizer_config.json) and a small JSONL
    text corpus: nothing downloaded."""
    import random

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    os.makedirs(os.path.join(folder, "tok"), exist_ok=True)
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.save(os.path.join(folder, "tok", "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    with open(os.path.join(folder, "tok", "tokenizer_config.json"), "w") as out:
        json.dump({**special, "unk_token": "<unk>"}, out)
    rnd = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "commits"]
    with open(os.path.join(folder, "data", "train.jsonl"), "w") as out:
        for _ in range(300):
            text = " ".join(rnd.choice(words) for _ in range(rnd.randint(10, 60)))
            out.write(json.dumps({"text": text}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["make-assets"]:
        make_assets(sys.argv[2])
        sys.exit(0)
    sys.modules.setdefault("torchtitan_worker", sys.modules["__main__"])
    _record_losses()
    _kill_in_save()
    from torchtitan.train import main

    main()
