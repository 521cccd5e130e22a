"""Zephon: exact, cheap resumption for ML training jobs.

Names are resolved lazily so that ``import zephon`` (and the ``zephon`` command's catalog and gc
subcommands) work without torch and stay fast; torch is imported only where tensors are handled.
"""

from __future__ import annotations

import importlib
from typing import Any

from catalog.errors import CatalogError
from storage.errors import StorageError
from zephon.errors import ConfigError, StaleAttemptError, ZephonError

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    # checkpointing (imports torch when first used)
    "CheckpointManager": "zephon.checkpointing",
    "Resume": "zephon.checkpointing",
    "export_safetensors": "zephon.checkpointing",
    "CheckpointingConfig": "zephon.config",
    "ModelStageConfig": "zephon.config",
    "JobConfig": "zephon.config",
    "load_job_config": "zephon.config",
    # data pipeline (zephon.pipeline)
    "Dataset": "zephon.pipeline",
    "InMemoryShard": "zephon.pipeline",
    "StaticMixtureWorkSource": "zephon.pipeline",
    "MixtureSpec": "zephon.pipeline",
    "Pipeline": "zephon.pipeline",
    "PipelineStateful": "zephon.pipeline.torch_adapter",
    "check_elastic_config": "zephon.pipeline",
    "Batch": "zephon.pipeline",
    "Record": "zephon.pipeline",
    "PipelineError": "zephon.pipeline",
    "PipelineStateError": "zephon.pipeline",
    "AggregationTimeoutError": "zephon.pipeline",
}

__all__ = [
    "CatalogError",
    "ConfigError",
    "StaleAttemptError",
    "StorageError",
    "ZephonError",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
