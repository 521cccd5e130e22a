"""Zephon's storage layer: checkpoints on any fsspec filesystem, made visible by an atomic
commit marker holding a manifest of every file (sizes and CRC32C).

Knows nothing of the catalog or torch.
"""

from storage.errors import (
    BackendUnavailableError,
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
    InvalidNameError,
    StaleAttemptError,
    StorageError,
    StorageOptionsRefusedError,
    WriteAbortedError,
)
from storage.layout import MARKER_NAME, validate_run, validate_step
from storage.lineage import AttemptRecord, Fence, Lineage
from storage.location import Location, mask_url, open_location
from storage.manifest import FileEntry, Manifest, validate_save_id
from storage.reader import CheckpointReader
from storage.scan import StepListing
from storage.store import CheckpointStore, Orphan, new_save_id
from storage.verify import FileProblem, VerifyReport
from storage.writer import CheckpointWriter

__all__ = [
    "MARKER_NAME",
    "AttemptRecord",
    "Fence",
    "Lineage",
    "StaleAttemptError",
    "new_save_id",
    "validate_save_id",
    "BackendUnavailableError",
    "StorageOptionsRefusedError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointStore",
    "CheckpointWriter",
    "CommitConflictError",
    "CorruptCheckpointError",
    "FileEntry",
    "FileProblem",
    "InvalidNameError",
    "Location",
    "Manifest",
    "Orphan",
    "StepListing",
    "StorageError",
    "VerifyReport",
    "WriteAbortedError",
    "mask_url",
    "open_location",
    "validate_run",
    "validate_step",
]
