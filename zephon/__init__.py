"""Zephon: exact, cheap resumption for ML training jobs.

Every name is resolved lazily, so that ``import zephon`` (and the ``zephon`` command's catalog
and gc subcommands) work without torch and stay fast, and so that importing one layer
(``zephon.storage``, ``zephon.catalog``) loads nothing of the others: torch is imported only where
tensors are handled, SQLAlchemy only where the catalog is used.

The layers install under this package (``zephon.storage``, ``zephon.catalog``,
``zephon.migrations``), so a user's own ``storage.py`` or ``catalog/`` never shadows them.

The errors: the three roots (``ZephonError``, ``StorageError``, ``CatalogError``) cover
everything Zephon raises on purpose, and ``CheckpointNotFoundError`` (a ``StorageError``)
is the one error for "there is no such checkpoint", wherever it is asked.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    # errors
    "CatalogError": "zephon.catalog",
    "CheckpointNotFoundError": "zephon.storage",
    "StorageError": "zephon.storage",
    **{
        name: "zephon.errors"
        for name in (
            "ArgumentTypeError",
            "CatalogOutageError",
            "ConfigError",
            "NotCommittedError",
            "SaveBelowLatestError",
            "StaleAttemptError",
            "UsageError",
            "ZephonError",
        )
    },
    # checkpointing (imports torch when first used)
    "CheckpointManager": "zephon.checkpointing",
    "Resume": "zephon.checkpointing",
    "export_safetensors": "zephon.checkpointing",
    "CheckpointingConfig": "zephon.config",
    "ModelStageConfig": "zephon.config",
    "JobConfig": "zephon.config",
    "load_job_config": "zephon.config",
    "EmergencySaveConfig": "zephon.emergency",
    "Preempted": "zephon.emergency",
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

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
