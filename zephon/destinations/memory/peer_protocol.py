"""The memory tier's peer transport, the parts both ends share: its errors, the framing of its
requests and replies, and the rules a relative path must follow.

The protocol, over one TCP connection per client, reused for many requests:

- a *frame* is a 4-byte big-endian length, then that many bytes of UTF-8 JSON holding one
  object. Requests are at most ``MAX_REQUEST`` bytes (the server reads nothing longer);
  replies at most ``MAX_REPLY`` (a listing can be long). Nothing else is ever parsed: no
  pickle, no eval;
- the client's first frame is ``{"op": "hello", "version": 1, "token": ...}``; the server
  compares the token with ``hmac.compare_digest`` before it reads anything else, and answers
  ``{"ok": true}`` or an error;
- every later request is one frame, with ``op`` one of ``put``, ``fetch``, ``read``,
  ``list``, ``delete``. A ``put`` is answered ``{"ok": true}`` once the server is ready to
  receive; the client then sends exactly ``size`` raw bytes and the server answers again once
  they are checked and in place. A ``fetch`` or ``read`` is answered with the byte count that
  follows, then those raw bytes;
- a refused request gets ``{"ok": false, "error": "..."}`` and the server closes the
  connection (the client opens a new one for its next request).
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import struct

from zephon.errors import ZephonError

__all__ = [
    "CHUNK",
    "MAX_REPLY",
    "MAX_REQUEST",
    "PART_SUFFIX",
    "VERSION",
    "PeerError",
    "PeerTransferError",
    "PeerUnavailableError",
    "ProtocolError",
    "check_relpath",
    "recv_exact",
    "recv_frame",
    "send_frame",
    "tune_socket",
]

VERSION = 1
#: the largest request frame the server reads (a path and a few numbers need far less)
MAX_REQUEST = 64 << 10
#: the largest reply frame a client reads (a listing of many files)
MAX_REPLY = 64 << 20
#: the bytes one receive moves (socket -> checksum -> file), with one buffer per connection
CHUNK = 4 << 20
#: the suffix of a file being received, renamed away once complete; never listed nor accepted
PART_SUFFIX = ".peer-part"
#: the longest relative path accepted
MAX_PATH = 4096

_LENGTH = struct.Struct(">I")


class PeerError(ZephonError):
    """Root of the peer transport's errors; ``peer`` is the other end, ``host:port``."""

    def __init__(self, message: str, *, peer: str) -> None:
        super().__init__(message)
        self.peer = peer

    def __reduce__(self):  # a rank's error is sent to the others pickled: rebuilt from its data
        return _rebuild, (type(self), str(self), self.peer)


class PeerUnavailableError(PeerError):
    """The peer could not be reached or stopped answering: connection refused, timed out or
    lost. Retrying may work once the peer is back (or another peer holds the files)."""


class PeerTransferError(PeerError):
    """The peer (or this end) refused a transfer: a size or CRC32C mismatch, a path outside
    the served directory, a wrong token, a missing file. Retrying the same request fails the
    same way."""


class ProtocolError(Exception):
    """A frame that breaks the protocol (internal: each end turns it into its own reply or
    error)."""


def _rebuild(cls: type[PeerError], message: str, peer: str) -> PeerError:
    return cls(message, peer=peer)


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay (requests are small and answered at once) and keepalive probes, so that
    a vanished peer is noticed on an idle connection.

    The buffer sizes are left to the kernel on purpose: Linux grows them per connection up to
    ``net.ipv4.tcp_rmem``/``tcp_wmem``'s maximum (MiBs), while setting ``SO_RCVBUF`` or
    ``SO_SNDBUF`` turns that off and is capped by ``net.core.rmem_max``, 208 KiB on many
    hosts: a fixed size would be smaller on most clusters (benchmarks/peer_transport.py
    measured no gain from 4 MiB on 127.0.0.1)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def send_frame(sock: socket.socket, message: dict) -> None:
    """Send one frame holding ``message``."""
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_frame(sock: socket.socket, limit: int) -> dict | None:
    """The next frame's object; None if the connection ended cleanly before a frame began.
    ``ProtocolError`` for a frame longer than ``limit``, one that is not a JSON object, or a
    connection that ended inside a frame."""
    head = recv_exact(sock, _LENGTH.size, allow_eof=True)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        raise ProtocolError(f"a frame of {length} bytes is longer than the {limit} allowed")
    body = recv_exact(sock, length)
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: "[[[[..."
        raise ProtocolError("a frame that is not UTF-8 JSON") from None
    if not isinstance(message, dict):
        raise ProtocolError("a frame that is not a JSON object")
    return message


def recv_exact(sock: socket.socket, count: int, *, allow_eof: bool = False) -> bytes | None:
    """Exactly ``count`` bytes (for frames: small). The connection ending before any byte
    gives None if ``allow_eof``; ending anywhere else raises ``ConnectionError``."""
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0 and allow_eof:
                return None
            raise ConnectionError("the connection was closed by the other end")
        got += n
    return bytes(buffer)


def check_relpath(relpath: object, *, allow_root: bool = False) -> str:
    """``relpath`` if it is a path the transport accepts, else ``ValueError`` saying why.

    Accepted: a string of '/'-separated names, relative, already normal (no '.', '..' or
    empty parts), without backslashes, NUL or control characters, no name longer than 255
    bytes nor ending in ``PART_SUFFIX``; "" only where ``allow_root`` (a listing of
    everything). Where it resolves on disk is checked by the server (symlinks)."""
    if not isinstance(relpath, str):
        raise ValueError(f"a path must be a string, got {type(relpath).__name__}")
    if relpath == "" and allow_root:
        return relpath
    if not relpath or len(relpath) > MAX_PATH:
        raise ValueError(f"a path must have 1 to {MAX_PATH} characters")
    shown = repr(relpath[:200])
    if "\\" in relpath or any(ord(c) < 32 or ord(c) == 127 for c in relpath):
        raise ValueError(f"path {shown} holds a backslash, NUL or control character")
    if relpath.startswith("/"):
        raise ValueError(f"path {shown} is absolute; give it relative to the served directory")
    parts = relpath.split("/")
    if ".." in parts:
        raise ValueError(f"path {shown} climbs out with '..'")
    if posixpath.normpath(relpath) != relpath or "." in parts:
        raise ValueError(f"path {shown} is not normal (empty or '.' parts, a trailing '/')")
    for part in parts:
        if len(part.encode("utf-8", "surrogatepass")) > 255:
            raise ValueError(f"path {shown} has a name longer than 255 bytes")
        if part.endswith(PART_SUFFIX):
            raise ValueError(f"path {shown} ends in {PART_SUFFIX}, kept for files in transfer")
    return relpath


def place(fd: int, part: str, final: str) -> None:
    """A received file whose size and CRC32C were checked: flushed to disk and closed (``fd``),
    then renamed from its temporary name ``part`` to ``final`` (readers see all or nothing).
    ``OSError`` as it comes; ``fd`` is closed either way."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, final)
