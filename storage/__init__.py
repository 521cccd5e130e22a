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

from zephon.storage.backend import (
    CreateOutcome,
    ListedFile,
    create_exclusive,
    create_settled,
    file_exists,
    forget_cached,
    is_dir,
    list_files,
    make_dirs,
    open_read,
    put_small,
    read_file,
    read_small,
    remove_empty_dirs,
    remove_files,
)
from zephon.storage.backends import Backend
from zephon.storage.checksum import Crc32c, crc32c_extend, crc32c_of, decode_crc32c, encode_crc32c
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
from zephon.storage.lineage import AttemptRecord, Fence, Lineage, newer_epochs
from zephon.storage.location import Location, mask_url, open_location
from zephon.storage.manifest import FileEntry, Manifest, validate_save_id
from zephon.storage.parallel import concurrently
from zephon.storage.reader import CheckpointReader
from zephon.storage.redact import redact, redact_options, secrets_in
from zephon.storage.retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy
from zephon.storage.run_store import RunStore, new_save_id
from zephon.storage.scan import StepListing
from zephon.storage.store import CheckpointStore, Orphan
from zephon.storage.verify import FileProblem, VerifyReport, verify_checkpoint
from zephon.storage.writer import CheckpointWriter

__all__ = [
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
