"""PyTorch Distributed Checkpoint (DCP) on Zephon's storage layer.

Every rank writes its own shard files through its own ``storage.CheckpointWriter``; the
coordinator's ``finish`` commits the checkpoint with a marker listing every rank's files. The
DCP metadata is stored as versioned JSON, never pickled. See ``docs/dcp.md``.

Imports torch; ``import zephon`` alone does not import this package.
"""

from zephon.dcp.api import as_zephon_error, async_save, attach_ranks, load, save
from zephon.dcp.dropin import Writer
from zephon.dcp.dropin_reader import Reader, ReaderDisagreementError
from zephon.dcp.errors import (
    CoordinatorError,
    DCPError,
    DistributedCheckpointError,
    MetadataEncodingError,
    StateDictMismatchError,
    UnsafeItemError,
    WriterSetupError,
)
from zephon.dcp.metadata_codec import ShardSlice, decode_metadata, encode_metadata
from zephon.dcp.planner import ZephonLoadPlanner
from zephon.dcp.reader import ZephonStorageReader
from zephon.dcp.staging import ZephonStager
from zephon.dcp.stock_format import stock_directory
from zephon.dcp.writer import METADATA_FILE, ZephonStorageWriter

__all__ = [
    "METADATA_FILE",
    "CoordinatorError",
    "DCPError",
    "DistributedCheckpointError",
    "MetadataEncodingError",
    "Reader",
    "ReaderDisagreementError",
    "ShardSlice",
    "StateDictMismatchError",
    "UnsafeItemError",
    "Writer",
    "WriterSetupError",
    "ZephonLoadPlanner",
    "ZephonStager",
    "ZephonStorageReader",
    "ZephonStorageWriter",
    "as_zephon_error",
    "async_save",
    "attach_ranks",
    "decode_metadata",
    "encode_metadata",
    "load",
    "save",
    "stock_directory",
]
