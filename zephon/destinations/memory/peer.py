"""The memory tier's peer transport: each node serves its memory directory (``PeerServer``)
and copies its files to, or fetches them from, a peer node (``PeerClient``), over direct TCP.

Self-contained: no torch, no catalog; checksums are the storage layer's CRC32C, encoded as
in manifests. The protocol and its rules are described in ``peer_protocol``; errors are
``PeerUnavailableError`` (the peer cannot be reached or stopped answering) and
``PeerTransferError`` (a refused transfer), both ``PeerError``, a ``ZephonError``.
"""

from zephon.destinations.memory.peer_client import PeerClient
from zephon.destinations.memory.peer_protocol import (
    PeerError,
    PeerTransferError,
    PeerUnavailableError,
)
from zephon.destinations.memory.peer_server import PeerServer

__all__ = [
    "PeerClient",
    "PeerError",
    "PeerServer",
    "PeerTransferError",
    "PeerUnavailableError",
]
