"""Zephon's storage layer: checkpoints on any fsspec filesystem, made visible by an atomic
commit marker holding a manifest of every file (sizes and CRC32C).

Knows nothing of the catalog or torch.

Besides checkpoints, the public API offers what a layer that keeps its own small files on a
``Location`` needs (``zephon.pipeline``'s aggregation, ``zephon.dcp``'s reader): the backend
primitives of ``storage.backend`` (``list_files``, ``read_small``, ``create_settled``, ...,
each a call of the location's ``Backend``, which translates its failures into
``BackendUnavailableError`` once), the CRC32C helpers of ``storage.checksum``, the name and step
checks of ``storage.layout`` (``parse_number``: every number read from a name or argument),
``parse_json`` (every JSON document read from storage, depth-limited), the redaction of
secrets from messages (``storage.redact``), ``concurrently`` (requests sent together) and
``verify_checkpoint`` (a copy of a checkpoint, e.g. a local download, checked against its
manifest). Every backend primitive tries transient failures again under the location's
``RetryPolicy`` (``storage.retry``). Other layers import only these names.
"""

import importlib
from typing import Any

# Light modules (no fsspec, no backend): imported with the package. ``storage.redact`` must be
# among them: its module name is also the name of its function, so importing the module later
# would make ``zephon.storage.redact`` the module.
from zephon.storage.errors import (
    BackendUnavailableError,
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
    FencedOutError,
    InvalidArgumentError,
    InvalidNameError,
    StorageError,
    StorageOptionsRefusedError,
    WriteAbortedError,
)
from zephon.storage.jsondoc import MAX_JSON_DEPTH, JsonDocumentError, parse_json
from zephon.storage.layout import (
    MARKER_NAME,
    MAX_STEP,
    parse_number,
    parse_step_dirname,
    validate_file_name,
    validate_run,
    validate_step,
)
from zephon.storage.parallel import ahead, concurrently
from zephon.storage.redact import mask_url, redact, redact_options, secrets_in
from zephon.storage.retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy

# public name -> module that defines it, for the names whose modules load fsspec and the
# backends (or CRC32C's library): resolved on first use, so that a command that never touches
# storage (``zephon latest`` answered by the catalog, ``zephon --help``) does not pay for them.
_LAZY = {
    **{
        name: "zephon.storage.backend"
        for name in (
            "CreateOutcome",
            "ListedFile",
            "create_exclusive",
            "create_settled",
            "file_exists",
            "forget_cached",
            "is_dir",
            "list_files",
            "make_dirs",
            "open_read",
            "put_small",
            "read_file",
            "read_small",
            "remove_empty_dirs",
            "remove_files",
        )
    },
    "Backend": "zephon.storage.backends",
    **{
        name: "zephon.storage.checksum"
        for name in ("Crc32c", "crc32c_extend", "crc32c_of", "decode_crc32c", "encode_crc32c")
    },
    **{
        name: "zephon.storage.lineage"
        for name in ("AttemptRecord", "Fence", "Lineage", "newer_epochs")
    },
    **{name: "zephon.storage.chunks" for name in ("CHUNK_SCOPES", "ChunkRef", "DEFAULT_MAX_CHUNK")},
    "ChunkSweep": "zephon.storage.chunk_sweep",
    "Location": "zephon.storage.location",
    "open_location": "zephon.storage.location",
    **{name: "zephon.storage.manifest" for name in ("FileEntry", "Manifest", "validate_save_id")},
    "CheckpointReader": "zephon.storage.reader",
    "RunStore": "zephon.storage.run_store",
    "new_save_id": "zephon.storage.run_store",
    "StepListing": "zephon.storage.scan",
    "CheckpointStore": "zephon.storage.store",
    "Orphan": "zephon.storage.store",
    **{
        name: "zephon.storage.verify"
        for name in ("FileProblem", "VerifyReport", "verify_checkpoint")
    },
    "CheckpointWriter": "zephon.storage.writer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon.storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "CHUNK_SCOPES",
    "ChunkRef",
    "ChunkSweep",
    "DEFAULT_MAX_CHUNK",
    "MARKER_NAME",
    "MAX_JSON_DEPTH",
    "JsonDocumentError",
    "parse_json",
    "AttemptRecord",
    "Fence",
    "Lineage",
    "FencedOutError",
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
    "InvalidArgumentError",
    "InvalidNameError",
    "Location",
    "Manifest",
    "Orphan",
    "RunStore",
    "RetryPolicy",
    "DEFAULT_RETRY",
    "NO_RETRY",
    "StepListing",
    "StorageError",
    "VerifyReport",
    "verify_checkpoint",
    "WriteAbortedError",
    "mask_url",
    "open_location",
    "validate_run",
    "validate_step",
    # names, steps and secrets in messages (storage.layout, storage.lineage, storage.redact)
    "MAX_STEP",
    "parse_step_dirname",
    "parse_number",
    "validate_file_name",
    "newer_epochs",
    "redact",
    "redact_options",
    "secrets_in",
    # requests sent together (storage.parallel)
    "ahead",
    "concurrently",
    # backends and their primitives (storage.backends, storage.backend)
    "Backend",
    "CreateOutcome",
    "ListedFile",
    "create_exclusive",
    "create_settled",
    "file_exists",
    "forget_cached",
    "is_dir",
    "list_files",
    "make_dirs",
    "open_read",
    "put_small",
    "read_file",
    "read_small",
    "remove_empty_dirs",
    "remove_files",
    # CRC32C (storage.checksum)
    "Crc32c",
    "crc32c_extend",
    "crc32c_of",
    "decode_crc32c",
    "encode_crc32c",
]
