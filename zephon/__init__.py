"""Zephon: exact, cheap resumption for ML training jobs.

Names are resolved lazily so that ``import zephon`` (and the ``zephon`` command's catalog and gc
subcommands) work without torch and stay fast; torch is imported only where tensors are handled.

The errors are imported eagerly: the three roots (``ZephonError``, ``StorageError``,
``CatalogError``) cover everything Zephon raises on purpose, and ``CheckpointNotFoundError``
(a ``StorageError``) is the one error for "there is no such checkpoint", wherever it is asked.
"""

from __future__ import annotations

import importlib
from typing import Any

from zephon.catalog import CatalogError
from zephon.errors import (
    ArgumentTypeError,
    CatalogOutageError,
    ConfigError,
    NotCommittedError,
    SaveBelowLatestError,
    StaleAttemptError,
    UsageError,
    ZephonError,
)
from zephon.storage import CheckpointNotFoundError, StorageError

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
    "ArgumentTypeError",
    "CatalogError",
    "CatalogOutageError",
    "CheckpointNotFoundError",
    "ConfigError",
    "NotCommittedError",
    "SaveBelowLatestError",
    "StaleAttemptError",
    "StorageError",
    "UsageError",
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
