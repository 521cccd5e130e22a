"""Which backend class serves which fsspec protocol: the one table of protocols.

``backend_for(protocol)`` is asked once, where a location is opened; everything after asks the
``Backend`` it returned. A protocol without a class of its own gets the generic ``Backend``
(any fsspec filesystem, best-effort markers); ``PACKAGES`` names what to install for the
protocols fsspec knows but that need a package.
"""

from __future__ import annotations

from zephon.storage.backends.azure import AzureBackend
from zephon.storage.backends.base import Backend
from zephon.storage.backends.memory import MemoryBackend
from zephon.storage.backends.object_store import GCSBackend, S3Backend
from zephon.storage.backends.posix import PosixBackend
from zephon.storage.errors import InvalidArgumentError

__all__ = ["BACKEND_CLASSES", "PACKAGES", "backend_for", "package_for", "register"]

#: every backend class with its own behaviour, in the order the tests run them
BACKEND_CLASSES: list[type[Backend]] = []
_BY_PROTOCOL: dict[str, type[Backend]] = {}

#: packages providing fsspec protocols that have no backend class here, for the install hint
#: (a registered class names its own ``package``)
PACKAGES = {
    "hf": "huggingface_hub",
    "sftp": "paramiko",
    "ssh": "paramiko",
    "hdfs": "pyarrow",
    "webhdfs": "requests",
    "oci": "ocifs",
    "oss": "ossfs",
}


def register(cls: type[Backend]) -> type[Backend]:
    """Make ``cls`` the backend of every protocol in ``cls.protocols`` (usable as a class
    decorator). A protocol registered twice keeps the newer class."""
    if not cls.protocols:
        raise InvalidArgumentError(
            f"backend class {cls.__name__} has no protocols: set {cls.__name__}.protocols to "
            "the fsspec protocols it serves before registering it"
        )
    if cls not in BACKEND_CLASSES:
        BACKEND_CLASSES.append(cls)
    for protocol in cls.protocols:
        _BY_PROTOCOL[protocol] = cls
    return cls


for _cls in (PosixBackend, MemoryBackend, S3Backend, GCSBackend, AzureBackend):
    register(_cls)


def backend_for(protocol: str) -> type[Backend]:
    """The backend class of an fsspec protocol (the generic ``Backend`` if none is
    registered)."""
    return _BY_PROTOCOL.get(protocol, Backend)


def package_for(protocol: str) -> str | None:
    """The package that provides ``protocol`` in fsspec, if one is known."""
    return _BY_PROTOCOL[protocol].package if protocol in _BY_PROTOCOL else PACKAGES.get(protocol)
