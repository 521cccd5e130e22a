"""Storage backends: one class per family of fsspec filesystems, chosen once per location.

``Backend`` (``base``) works on any fsspec filesystem; ``PosixBackend`` (local disk),
``S3Backend``, ``GCSBackend`` and ``AzureBackend`` (object stores) and ``MemoryBackend``
(fsspec's in-process memory filesystem) do better where they can and say so in their
capability flags. The registry maps protocols to classes. Adding a backend: subclass, set
``protocols`` and the flags, override what differs, ``register`` it, and run
``tests/storage/test_backend_conformance.py`` against it.
"""

from zephon.storage.backends.azure import AzureBackend
from zephon.storage.backends.base import Backend, ListedFile, mtime_of
from zephon.storage.backends.memory import MemoryBackend
from zephon.storage.backends.object_store import (
    DEFAULT_POOL_CONNECTIONS,
    GCSBackend,
    ObjectStoreBackend,
    S3Backend,
)
from zephon.storage.backends.posix import PosixBackend, fsync_dir
from zephon.storage.backends.registry import BACKEND_CLASSES, backend_for, package_for, register

__all__ = [
    "BACKEND_CLASSES",
    "DEFAULT_POOL_CONNECTIONS",
    "AzureBackend",
    "Backend",
    "GCSBackend",
    "ListedFile",
    "MemoryBackend",
    "ObjectStoreBackend",
    "PosixBackend",
    "S3Backend",
    "backend_for",
    "fsync_dir",
    "mtime_of",
    "package_for",
    "register",
]
