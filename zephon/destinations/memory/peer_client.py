"""The client side of the memory tier's peer transport: puts this node's files on a peer,
fetches them back, reads ranges, lists and deletes (the protocol: ``peer_protocol``).

One connection per client, opened at the first request and reused; a request that finds its
reused connection closed by the peer (the peer restarted, or dropped it after an error) is
sent once more on a new one. Every blocking step waits at most ``timeout_s``: a dead peer is
noticed within it, a refused connection at once.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

from zephon.destinations.memory.peer_protocol import (
    CHUNK,
    MAX_REPLY,
    PART_SUFFIX,
    VERSION,
    PeerTransferError,
    PeerUnavailableError,
    ProtocolError,
    check_relpath,
    place,
    recv_frame,
    send_frame,
    tune_socket,
)
from zephon.errors import UsageError
from zephon.storage import crc32c_extend, crc32c_of, decode_crc32c, encode_crc32c

__all__ = ["PeerClient"]

T = TypeVar("T")


class _Rejected(Exception):
    """The peer answered a request with an error (its message)."""


class _Failed(Exception):
    """This end refused a transfer (a size or CRC32C mismatch, a local file it cannot write)."""


class PeerClient:
    """Talks to one peer's ``PeerServer`` at ``address`` with the job's ``token``.

    Thread-safe (requests on one client are sent one at a time). ``PeerUnavailableError`` when
    the peer cannot be reached or stops answering within ``timeout_s`` seconds,
    ``PeerTransferError`` when it (or this end) refuses a transfer; both name the peer.
    """

    def __init__(self, address: tuple[str, int], token: str, timeout_s: float = 30.0) -> None:
        if not isinstance(token, str) or not token:
            raise UsageError("PeerClient: token must be a non-empty string (the job's secret)")
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise UsageError(f"PeerClient: timeout_s = {timeout_s!r} is invalid: give seconds > 0")
        host, port = address
        self.address = (str(host), int(port))
        self.peer = f"{self.address[0]}:{self.address[1]}"
        self.timeout_s = float(timeout_s)
        self._token = token
        self._sock: socket.socket | None = None
        self._buffer: bytearray | None = None
        self._lock = threading.Lock()

    # -- requests ---------------------------------------------------------------------------

    def put_file(self, local_path: str, relpath: str, crc32c: str, size: int) -> None:
        """Copy the local file ``local_path`` to the peer as ``relpath``, streamed (never whole
        in memory). The peer checks its ``size`` and ``crc32c`` (encoded as in manifests) as
        it receives, and renames it into place only if both match."""
        _check_path(relpath)
        _check_crc(crc32c)
        what = f"put of {relpath!r} (from {local_path})"
        try:
            file = open(local_path, "rb", buffering=0)  # noqa: SIM115 (closed below)
        except OSError as error:
            raise self._transfer(what, f"cannot read the local file: {error.strerror}") from None
        with file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise self._transfer(
                    what, f"the local file has {info.st_size} bytes, not the {size} declared"
                )

            def put(sock: socket.socket) -> None:
                send_frame(sock, {"op": "put", "path": relpath, "size": size, "crc32c": crc32c})
                _expect_ok(sock)
                if size and sock.sendfile(file, 0, size) != size:
                    raise _Failed("the local file shrank while it was sent")
                _expect_ok(sock)

            self._call(what, put)

    def put_bytes(self, data: bytes, relpath: str, crc32c: str | None = None) -> None:
        """Put a small document (a marker, a JSON record) on the peer as ``relpath``, renamed
        into place as ``put_file``'s are; ``crc32c`` is computed here if not given."""
        _check_path(relpath)
        if crc32c is None:
            crc32c = crc32c_of(data)
        _check_crc(crc32c)
        header = {"op": "put", "path": relpath, "size": len(data), "crc32c": crc32c}

        def put(sock: socket.socket) -> None:
            send_frame(sock, header)
            _expect_ok(sock)
            sock.sendall(data)
            _expect_ok(sock)

        self._call(f"put of {relpath!r}", put)

    def fetch_file(self, relpath: str, dest_path: str, crc32c: str, size: int) -> None:
        """Copy the peer's ``relpath`` to the local ``dest_path``: streamed into a temporary
        file beside it (its directory is created if missing), renamed into place only if its
        ``size`` and ``crc32c`` match."""
        _check_path(relpath)
        expected = _check_crc(crc32c)
        what = f"fetch of {relpath!r} (to {dest_path})"

        def fetch(sock: socket.socket) -> None:
            send_frame(sock, {"op": "fetch", "path": relpath})
            held = _size_of(_expect_ok(sock))
            if held != size:
                raise _Failed(f"the peer holds {held} bytes, not {size}")
            self._receive_file(sock, dest_path, size, expected, crc32c)

        self._call(what, fetch)

    def read_range(self, relpath: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the peer's ``relpath`` from ``offset``; a range past the end
        of the file is refused."""
        _check_path(relpath)
        for name, value in (("offset", offset), ("length", length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UsageError(f"read_range: {name} = {value!r} is invalid: give an int >= 0")

        def read(sock: socket.socket) -> bytes:
            send_frame(sock, {"op": "read", "path": relpath, "offset": offset, "length": length})
            if _size_of(_expect_ok(sock)) != length:
                raise ProtocolError("the peer announced another length than asked")
            buffer = bytearray(length)
            _recv_into(sock, memoryview(buffer))
            return bytes(buffer)

        return self._call(f"read of {relpath!r} [{offset}:{offset + length}]", read)

    def listing(self, prefix: str) -> list[tuple[str, int]]:
        """``(relpath, size)`` of every file under the peer's directory ``prefix`` ("" for
        all), sorted; empty if there is no such directory. Files in transfer are not listed."""
        _check_path(prefix, allow_root=True)

        def listing(sock: socket.socket) -> list[tuple[str, int]]:
            send_frame(sock, {"op": "list", "prefix": prefix})
            entries = _expect_ok(sock).get("entries")
            if not isinstance(entries, list) or not all(_is_entry(e) for e in entries):
                raise ProtocolError("a listing that is not a list of [path, size]")
            return [(path, size) for path, size in entries]

        return self._call(f"listing of {prefix!r}", listing)

    def delete(self, prefix: str) -> None:
        """Remove the peer's file or directory tree ``prefix``; nothing to remove is fine."""
        _check_path(prefix)

        def delete(sock: socket.socket) -> None:
            send_frame(sock, {"op": "delete", "path": prefix})
            _expect_ok(sock)

        self._call(f"delete of {prefix!r}", delete)

    def close(self) -> None:
        """Close the connection (a later request opens a new one). Idempotent."""
        with self._lock:
            self._drop()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the connection ---------------------------------------------------------------------

    def _call(self, what: str, request: Callable[[socket.socket], T]) -> T:
        """Run ``request`` on the connection, translating every failure into this module's
        errors (the connection is dropped after any failure: it may be out of step)."""
        with self._lock:
            for attempt in range(2):
                reused = self._sock is not None
                sock = self._sock if reused else self._connect(what)
                try:
                    return request(sock)
                except _Rejected as refused:
                    self._drop()
                    raise self._transfer(what, f"refused by the peer: {refused}") from None
                except _Failed as refused:
                    self._drop()
                    raise self._transfer(what, str(refused)) from None
                except ProtocolError as broken:
                    self._drop()
                    raise self._transfer(what, f"a malformed reply ({broken})") from None
                except TimeoutError:
                    self._drop()
                    raise self._unavailable(what, f"no answer within {self.timeout_s:g}s") from None
                except OSError as lost:  # ConnectionError and the socket's other failures
                    self._drop()
                    if reused and attempt == 0 and isinstance(lost, ConnectionError):
                        continue  # the peer closed the idle connection: once more, anew
                    raise self._unavailable(what, f"connection lost ({_reason(lost)})") from None
                except BaseException:  # e.g. KeyboardInterrupt mid-transfer: out of step
                    self._drop()
                    raise
        raise AssertionError("unreachable")

    def _connect(self, what: str) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except TimeoutError:
            raise self._unavailable(what, f"no connection within {self.timeout_s:g}s") from None
        except OSError as error:
            raise self._unavailable(what, f"cannot connect ({_reason(error)})") from None
        try:
            tune_socket(sock)
            send_frame(sock, {"op": "hello", "version": VERSION, "token": self._token})
            _expect_ok(sock)
        except _Rejected as refused:
            sock.close()
            raise self._transfer(what, f"the peer refused the connection: {refused}") from None
        except ProtocolError as broken:
            sock.close()
            raise self._transfer(what, f"a malformed reply ({broken})") from None
        except TimeoutError:
            sock.close()
            raise self._unavailable(what, f"no answer within {self.timeout_s:g}s") from None
        except OSError as error:
            sock.close()
            raise self._unavailable(what, f"connection lost ({_reason(error)})") from None
        self._sock = sock
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _receive_file(
        self, sock: socket.socket, dest_path: str, size: int, expected: int, crc32c: str
    ) -> None:
        directory, name = os.path.split(os.path.abspath(dest_path))
        part = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}{PART_SUFFIX}")
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as error:
            raise _Failed(f"cannot create {part}: {error.strerror}") from None
        placed = False
        try:
            if self._buffer is None:
                self._buffer = bytearray(CHUNK)
            view = memoryview(self._buffer)
            crc = 0
            remaining = size
            while remaining:
                n = sock.recv_into(view, min(len(view), remaining))
                if n == 0:
                    raise ConnectionError("the peer closed the connection inside a fetch")
                crc = crc32c_extend(crc, view[:n])
                _write_all(fd, view[:n], part)
                remaining -= n
            if crc != expected:
                raise _Failed(
                    f"the bytes received have CRC32C {encode_crc32c(crc)}, not {crc32c}; "
                    "nothing was written"
                )
            try:
                fd, held = -1, fd
                place(held, part, dest_path)
                placed = True
            except OSError as error:
                raise _Failed(f"cannot write {dest_path}: {error.strerror}") from None
        finally:
            if fd >= 0:
                os.close(fd)
            if not placed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)

    # -- errors -----------------------------------------------------------------------------

    def _transfer(self, what: str, why: str) -> PeerTransferError:
        return PeerTransferError(f"peer {self.peer}: {what} failed: {why}", peer=self.peer)

    def _unavailable(self, what: str, why: str) -> PeerUnavailableError:
        return PeerUnavailableError(
            f"peer {self.peer} is unavailable: {why} ({what})", peer=self.peer
        )


# -- helpers --------------------------------------------------------------------------------------


def _check_path(relpath: str, *, allow_root: bool = False) -> None:
    try:
        check_relpath(relpath, allow_root=allow_root)
    except ValueError as bad:
        raise UsageError(f"PeerClient: {bad}") from None


def _check_crc(crc32c: str) -> int:
    try:
        return decode_crc32c(crc32c)
    except ValueError as bad:
        raise UsageError(f"PeerClient: crc32c is invalid: {bad}") from None


def _expect_ok(sock: socket.socket) -> dict:
    reply = recv_frame(sock, MAX_REPLY)
    if reply is None:
        raise ConnectionError("the peer closed the connection")
    if reply.get("ok") is not True:
        raise _Rejected(str(reply.get("error", "no reason given"))[:1000])
    return reply


def _size_of(reply: dict) -> int:
    size = reply.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ProtocolError("a reply without a byte count")
    return size


def _is_entry(entry: object) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], str)
        and isinstance(entry[1], int)
    )


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection inside a reply")
        got += n


def _write_all(fd: int, data: memoryview, path: str) -> None:
    written = 0
    while written < len(data):
        try:
            written += os.write(fd, data[written:])
        except OSError as error:
            raise _Failed(f"cannot write {path}: {error.strerror}") from None


def _reason(error: OSError) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, ConnectionResetError):
        return "connection reset"
    return error.strerror or str(error) or type(error).__name__
