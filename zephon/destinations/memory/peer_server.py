"""The server side of the memory tier's peer transport: one node's memory directory, served
to the job's other nodes over TCP (the protocol: ``peer_protocol``).

Each connection has a thread of its own. Nothing a client sends runs as code or reaches
outside the served directory: the token is checked before anything else, every path is checked
by ``check_relpath`` and then resolved (a symlink inside the directory pointing out is refused),
every size is bounded by what the request declared, and a file arrives under a temporary name
that is renamed into place only once its size and CRC32C match.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import shutil
import socket
import stat
import threading
import uuid

from zephon.destinations.memory.peer_protocol import (
    CHUNK,
    MAX_REQUEST,
    PART_SUFFIX,
    VERSION,
    ProtocolError,
    check_relpath,
    place,
    recv_frame,
    send_frame,
    tune_socket,
)
from zephon.errors import UsageError
from zephon.storage import crc32c_extend, decode_crc32c, encode_crc32c

__all__ = ["PeerServer"]

_log = logging.getLogger(__name__)

#: the time a new connection has to present its token
HELLO_TIMEOUT_S = 10.0
#: the longest a request may stall mid-way (a header half sent, bytes of a put that stopped)
IO_TIMEOUT_S = 60.0
#: connections served at once; more are closed at once
MAX_CONNECTIONS = 256
#: the largest file a put may declare (1 TiB)
MAX_SIZE = 1 << 40


class _Refused(Exception):
    """A request the server refuses: its message is the error reply."""


class PeerServer:
    """Serves one node's memory directory to the job's other nodes.

    ``root`` is the directory served (created if missing); ``token`` the job's shared secret,
    which every connection must present first; ``port=0`` binds a free port (``address`` is
    the one bound). Serving starts at once, on background threads; ``close()`` stops it.
    """

    def __init__(self, root: str, token: str, host: str = "0.0.0.0", port: int = 0) -> None:
        if not isinstance(token, str) or not token:
            raise UsageError("PeerServer: token must be a non-empty string (the job's secret)")
        os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self._token = token.encode("utf-8")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"zephon-peer-server-{self.address[1]}", daemon=True
        )
        self._acceptor.start()

    def close(self) -> None:
        """Stop accepting, close every connection (a transfer under way is abandoned, its
        temporary file removed) and join the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections.items())
        _shutdown(self._listener)
        self._listener.close()
        self._acceptor.join()
        for conn, _ in connections:
            _shutdown(conn)
        for _, thread in connections:
            thread.join()

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connections ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue  # e.g. ECONNABORTED, EMFILE: keep serving the others
            with self._lock:
                if self._closed or len(self._connections) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                thread = threading.Thread(
                    target=self._serve,
                    args=(conn,),
                    name=f"zephon-peer-conn-{self.address[1]}",
                    daemon=True,
                )
                self._connections[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = None
        try:
            tune_socket(conn)
            conn.settimeout(HELLO_TIMEOUT_S)
            if not self._hello(conn):
                return
            buffer = bytearray(CHUNK)
            while True:
                conn.settimeout(None)  # an idle client keeps its connection (keepalive probes)
                request = recv_frame(conn, MAX_REQUEST)
                if request is None:
                    return
                conn.settimeout(IO_TIMEOUT_S)
                try:
                    self._handle(conn, request, buffer)
                except _Refused as refused:
                    _reply_error(conn, str(refused))
                    return
        except ProtocolError as broken:
            _reply_error(conn, f"protocol error: {broken}")
        except (OSError, ConnectionError):
            pass  # the client went away or stalled; nothing to answer
        except Exception:  # a bug must not take the server down: log, drop this connection
            _log.exception("peer server: unexpected error serving a connection")
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()

    def _hello(self, conn: socket.socket) -> bool:
        hello = recv_frame(conn, MAX_REQUEST)
        if hello is None:
            return False
        token = hello.get("token")
        given = token.encode("utf-8", "surrogatepass") if isinstance(token, str) else b""
        if hello.get("op") != "hello" or not hmac.compare_digest(given, self._token):
            _reply_error(conn, "refused: the first request must be hello with the job's token")
            return False
        if hello.get("version") != VERSION:
            _reply_error(conn, f"refused: protocol version {VERSION} only")
            return False
        send_frame(conn, {"ok": True})
        return True

    def _handle(self, conn: socket.socket, request: dict, buffer: bytearray) -> None:
        op = request.get("op")
        if op == "put":
            self._put(conn, request, buffer)
        elif op == "fetch":
            self._fetch(conn, request)
        elif op == "read":
            self._read(conn, request)
        elif op == "list":
            send_frame(conn, {"ok": True, "entries": self._listing(request.get("prefix"))})
        elif op == "delete":
            self._delete(request.get("path"))
            send_frame(conn, {"ok": True})
        else:
            raise _Refused(f"unknown request {str(op)[:40]!r}")

    # -- paths ------------------------------------------------------------------------------

    def _resolve(self, relpath: object, *, allow_root: bool = False) -> str:
        """The absolute path of ``relpath`` under root, refused if the path breaks the rules
        or resolves (through symlinks) outside root."""
        try:
            relpath = check_relpath(relpath, allow_root=allow_root)
        except ValueError as bad:
            raise _Refused(f"refused: {bad}") from None
        full = os.path.join(self.root, relpath) if relpath else self.root
        if not self._inside(full):
            raise _Refused(f"refused: path {relpath!r} resolves outside the served directory")
        return full

    def _inside(self, path: str) -> bool:
        real = os.path.realpath(path)
        return real == self.root or real.startswith(self.root + os.sep)

    # -- requests ---------------------------------------------------------------------------

    def _put(self, conn: socket.socket, request: dict, buffer: bytearray) -> None:
        final = self._resolve(request.get("path"))
        size = request.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_SIZE:
            raise _Refused(f"refused: size must be an integer from 0 to {MAX_SIZE}")
        try:
            expected = decode_crc32c(request.get("crc32c"))
        except ValueError:
            raise _Refused("refused: crc32c must be the 8-character base64 of a CRC32C") from None
        parent, name = os.path.split(final)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as error:
            raise _Refused(f"cannot create the directory of {name!r}: {error.strerror}") from None
        if not self._inside(parent) or os.path.isdir(final):
            raise _Refused(f"refused: {request['path']!r} cannot be written here")
        part = os.path.join(parent, f".{name}.{uuid.uuid4().hex[:12]}{PART_SUFFIX}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(part, flags, 0o644)
        except OSError as error:
            raise _Refused(f"cannot create a file for {name!r}: {error.strerror}") from None
        placed = False
        try:
            send_frame(conn, {"ok": True})  # ready: the client sends the bytes now
            crc = _receive_into(conn, fd, size, buffer)
            if crc != expected:
                raise _Refused(
                    f"refused {request['path']!r}: its bytes have CRC32C {encode_crc32c(crc)}, "
                    f"not the {request['crc32c']} declared; nothing was written"
                )
            try:
                fd, held = -1, fd
                place(held, part, final)
                placed = True
                _fsync_directory(parent)
            except OSError as error:
                raise _Refused(f"cannot put {request['path']!r}: {error.strerror}") from None
        finally:
            if fd >= 0:
                os.close(fd)
            if not placed:
                _remove_quietly(part)
        send_frame(conn, {"ok": True})

    def _open_regular(self, relpath: object) -> tuple[int, int]:
        full = self._resolve(relpath)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise _Refused(f"no file {relpath!r} on this peer") from None
        except OSError as error:
            raise _Refused(f"cannot open {relpath!r}: {error.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise _Refused(f"{relpath!r} is not a file on this peer")
        return fd, info.st_size

    def _fetch(self, conn: socket.socket, request: dict) -> None:
        fd, size = self._open_regular(request.get("path"))
        with open(fd, "rb", buffering=0) as file:
            send_frame(conn, {"ok": True, "size": size})
            _send_file(conn, file, 0, size)

    def _read(self, conn: socket.socket, request: dict) -> None:
        offset, length = request.get("offset"), request.get("length")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length)):
            raise _Refused("refused: offset and length must be integers")
        fd, size = self._open_regular(request.get("path"))
        with open(fd, "rb", buffering=0) as file:
            if offset < 0 or length < 0 or offset + length > size:
                raise _Refused(
                    f"refused: bytes {offset}..{offset + length} of {request['path']!r} are "
                    f"outside its {size} bytes"
                )
            send_frame(conn, {"ok": True, "size": length})
            _send_file(conn, file, offset, length)

    def _listing(self, prefix: object) -> list[list]:
        top = self._resolve(prefix, allow_root=True)
        entries: list[list] = []
        try:
            info = os.lstat(top)
        except FileNotFoundError:
            return entries
        if stat.S_ISREG(info.st_mode):
            return [[prefix, info.st_size]]
        pending = [top]
        while pending:
            directory = pending.pop()
            try:
                with os.scandir(directory) as scan:
                    for entry in scan:
                        if entry.is_dir(follow_symlinks=False):
                            pending.append(entry.path)
                        elif entry.is_file(follow_symlinks=False) and not entry.name.endswith(
                            PART_SUFFIX
                        ):
                            rel = os.path.relpath(entry.path, self.root).replace(os.sep, "/")
                            size = entry.stat(follow_symlinks=False).st_size
                            entries.append([rel, size])
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed while listed
        entries.sort()
        return entries

    def _delete(self, relpath: object) -> None:
        full = self._resolve(relpath)
        for _ in range(3):  # a file put into the tree meanwhile: try again
            try:
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full)
                else:
                    os.unlink(full)
                return
            except FileNotFoundError:
                return
            except OSError as error:
                failure = error
        raise _Refused(f"cannot delete {relpath!r}: {failure.strerror}")


# -- helpers --------------------------------------------------------------------------------------


def _receive_into(conn: socket.socket, fd: int, size: int, buffer: bytearray) -> int:
    """Receive exactly ``size`` bytes into ``fd`` through ``buffer``; their CRC32C. A write
    that fails (a full memory directory) is reported once every byte declared is received,
    so that the client, still sending, reads the refusal and the connection stays in step."""
    view = memoryview(buffer)
    crc = 0
    remaining = size
    failed: OSError | None = None
    while remaining:
        n = conn.recv_into(view, min(len(view), remaining))
        if n == 0:
            raise ConnectionError("the client closed the connection inside a put")
        chunk = view[:n]
        crc = crc32c_extend(crc, chunk)
        remaining -= n
        written = 0
        while failed is None and written < n:
            try:
                written += os.write(fd, chunk[written:])
            except OSError as error:
                failed = error
    if failed is not None:
        raise _Refused(f"cannot write the file: {failed.strerror}; nothing was written")
    return crc


def _send_file(conn: socket.socket, file, offset: int, count: int) -> None:
    """Send ``count`` bytes of ``file`` from ``offset`` (the kernel's sendfile where it can);
    a file that shrank meanwhile ends the connection (the client sees it cut short)."""
    if count and conn.sendfile(file, offset, count) != count:
        raise ConnectionError("the file shrank while it was sent")


def _reply_error(conn: socket.socket, message: str) -> None:
    with contextlib.suppress(OSError):
        send_frame(conn, {"ok": False, "error": message})


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
