"""The checkpoint manager (seed 002): save every ``period_steps``, keep ``num_to_keep``, resume
exactly from the latest complete checkpoint on any number of ranks; export to safetensors.

Imports torch.
"""

from zephon.checkpointing.export import ExportResult, export_safetensors
from zephon.checkpointing.manager import ALREADY_COMPLETE, CheckpointManager, Resume
from zephon.checkpointing.source import load_frozen_from_source, read_model_tensors

__all__ = [
    "ALREADY_COMPLETE",
    "CheckpointManager",
    "ExportResult",
    "Resume",
    "export_safetensors",
    "load_frozen_from_source",
    "read_model_tensors",
]
