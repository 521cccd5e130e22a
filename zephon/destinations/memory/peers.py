"""The job's nodes as the memory tier sees them: which ranks share a node (a memory
directory), the ring of peers each node copies its part to, and the connections between
them (docs/tiers.md, "The memory tier").

A node is a place: a host and its memory directory. The lowest rank of each place is its
leader: it serves the directory to the other nodes (``peer_server.PeerServer``, direct TCP,
a random token of the job's shared over its process group) and does the node's deletes and
resume assembly. Every rank may send to and fetch from any node's server.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading

from zephon.collectives import Collectives
from zephon.destinations.memory.peer_client import PeerClient
from zephon.destinations.memory.peer_server import PeerServer

__all__ = ["PEER_HOST_ENV", "Nodes"]

#: the address this node's server is reached at by the other nodes (default: the address of
#: the interface that reaches ``MASTER_ADDR``, else this host's name)
PEER_HOST_ENV = "ZEPHON_PEER_HOST"


def _advertised_host() -> str:
    """The address other nodes reach this one at."""
    given = os.environ.get(PEER_HOST_ENV)
    if given:
        return given
    master = os.environ.get("MASTER_ADDR")
    if master:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError), probe:
            probe.connect((master, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    return socket.gethostname()


class Nodes:
    """The nodes of a job and the peer connections between them (construct on every rank at
    the same point: it all-gathers)."""

    def __init__(
        self, coll: Collectives, memory_dir: str, replicas: int, *, serve: bool = True
    ) -> None:
        self.rank = coll.rank
        place = (socket.gethostname(), os.path.realpath(memory_dir))
        places = coll.all_gather(place)
        order: list[tuple[str, str]] = []
        for other in places:
            if other not in order:
                order.append(other)
        #: node index of every rank
        self.node_of = [order.index(other) for other in places]
        #: this rank's node, and whether it leads it (serves, deletes, assembles)
        self.node = self.node_of[coll.rank]
        self.count = len(order)
        self.leader = places.index(place) == coll.rank
        #: the lowest rank of each node
        self.leaders = [places.index(other) for other in order]
        hosts = [host for host, _ in order]
        #: each node's name in the catalog: its host, with its directory when hosts repeat
        self.labels = [host if hosts.count(host) == 1 else f"{host}:{path}" for host, path in order]
        #: the nodes each node copies its part to: the next ``replicas`` in the ring
        self.replicas = min(replicas, self.count - 1)
        token = coll.from_main(lambda: secrets.token_hex(16), "share the peer token")
        self._token = token
        self.server: PeerServer | None = None
        if self.leader and serve:
            self.server = PeerServer(memory_dir, token, host="0.0.0.0", port=0)
        mine = (_advertised_host(), self.server.address[1]) if self.server is not None else None
        addresses = coll.all_gather(mine)
        #: each node's server address (its leader's)
        self.addresses = [addresses[leader] for leader in self.leaders]
        self._clients: dict[tuple[int, int], PeerClient] = {}
        self._lock = threading.Lock()

    def peers_of(self, node: int) -> list[int]:
        """The nodes holding copies of ``node``'s part: the next ones in the ring."""
        return [(node + step) % self.count for step in range(1, self.replicas + 1)]

    def client(self, node: int) -> PeerClient:
        """A connection to ``node``'s server (one per node and thread, made at first use: a
        connection carries one request at a time)."""
        key = (node, threading.get_ident())
        with self._lock:
            client = self._clients.get(key)
        if client is None:
            address = self.addresses[node]
            if address is None:
                raise RuntimeError(f"node {node} serves no memory directory")
            client = PeerClient((address[0], int(address[1])), self._token)
            with self._lock:
                self._clients[key] = client
        return client

    def drop(self, node: int) -> None:
        """Forget this thread's connection to ``node`` (after a failure: the next use
        connects again)."""
        with self._lock:
            client = self._clients.pop((node, threading.get_ident()), None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()
        if self.server is not None:
            self.server.close()
            self.server = None
