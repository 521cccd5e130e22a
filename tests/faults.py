"""A seeded fault-injecting HTTP proxy, put in front of moto's S3 server (or the GCS emulator)
to test what Zephon does when the network misbehaves.

    with FaultProxy(s3.endpoint_url, seed=7) as proxy:
        options = {**s3.storage_options(), "client_kwargs": {"endpoint_url": proxy.url}}
        proxy.set_rates(error=0.05, reset=0.01, drop=0.01)  # random faults on every request
        proxy.drop_reply(method="PUT", path=r"/_COMMIT$")  # applied by the server, reply lost
        proxy.outage(True)                           # every request fails until outage(False)

What a fault looks like to the client:

| outcome | what the proxy does |
|---|---|
| ``error`` | answers ``500 InternalError`` without forwarding |
| ``slow_down`` | answers ``503 SlowDown`` with ``Retry-After`` without forwarding |
| ``reset`` | resets the connection before any reply, without forwarding |
| ``outage`` | the same as ``reset``, for every request while the outage lasts |
| ``truncate`` | forwards; sends the reply's headers and only half of its body, then resets |
| ``stall`` | forwards; holds the reply ``stall_s`` seconds before sending it |
| ``drop_reply`` | forwards (the server applies the request), then resets: the reply is lost |
| ``fail`` | answers the scripted status (S3 error document) without forwarding |
| ``ok`` | forwards and relays the reply |

Scripted faults (``drop_reply``, ``fail``) match a request by method and a regular expression
searched in its path (with the query string) and apply to the next ``count`` matches; they win
over the random rates, and an outage wins over both. Random faults come from one
``random.Random(seed)``, so a single-threaded client sees the same faults on every run.

The proxy is a threaded HTTP/1.1 server on 127.0.0.1 (a free port unless ``port``) that reads
each request whole and forwards it on a fresh upstream connection; keep-alive towards the client
is kept, ``100 Continue`` is answered. Meant for tests and benchmarks on this machine only.
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass

__all__ = ["FaultProxy", "Request"]

#: headers that belong to one hop, never forwarded either way
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "expect",
        "content-length",
    }
)
_RANDOM_OUTCOMES = ("error", "slow_down", "reset", "drop_reply", "truncate", "stall")


@dataclass(frozen=True, slots=True)
class Request:
    """One request the proxy saw and what it did with it."""

    method: str
    path: str
    outcome: str


@dataclass(slots=True)
class _Rule:
    outcome: str
    method: str | None
    pattern: re.Pattern[str]
    count: int
    status: int = 503

    def matches(self, method: str, path: str) -> bool:
        if self.count <= 0:
            return False
        if self.method is not None and self.method.upper() != method:
            return False
        return self.pattern.search(path) is not None


class FaultProxy:
    """Forward 127.0.0.1:<port> to ``upstream``, injecting faults (see the module docstring).

    A context manager; the settings may be changed while it runs and apply to requests from
    then on. ``log`` lists every request seen since start or ``clear()``.
    """

    def __init__(self, upstream: str, seed: int = 0, port: int = 0) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(
                f"FaultProxy upstream {upstream!r} is not a plain http://host:port URL: pass "
                "the server's endpoint, e.g. http://127.0.0.1:5000"
            )
        self.upstream_host, self.upstream_port = parsed.hostname, parsed.port
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._rates: dict[str, float] = dict.fromkeys(_RANDOM_OUTCOMES, 0.0)
        self.stall_s = 2.0
        self.retry_after_s = 1
        self._outage = False
        self._rules: list[_Rule] = []
        self._log: list[Request] = []
        self._port = port
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- settings ------------------------------------------------------------------------------

    def set_rates(
        self,
        *,
        error: float = 0.0,
        slow_down: float = 0.0,
        reset: float = 0.0,
        drop: float = 0.0,
        truncate: float = 0.0,
        stall: float = 0.0,
        stall_s: float | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        """The probability of each random fault per request (they add up; at most 1);
        ``drop`` is the random form of ``drop_reply`` (applied by the server, reply lost)."""
        rates = {
            "error": error,
            "slow_down": slow_down,
            "reset": reset,
            "drop_reply": drop,
            "truncate": truncate,
            "stall": stall,
        }
        if any(r < 0 for r in rates.values()) or sum(rates.values()) > 1:
            raise ValueError(f"fault rates {rates} must be >= 0 and add up to at most 1")
        with self._lock:
            self._rates = rates
            if stall_s is not None:
                self.stall_s = stall_s
            if retry_after_s is not None:
                self.retry_after_s = retry_after_s

    def outage(self, on: bool = True) -> None:
        """While on, every request is answered by a connection reset (the server is down)."""
        with self._lock:
            self._outage = on

    def drop_reply(self, *, method: str | None = None, path: str = "", count: int = 1) -> None:
        """The next ``count`` matching requests reach the server, which applies them; their
        replies are lost (the connection is reset before any reply byte)."""
        self._add(_Rule("drop_reply", method, re.compile(path), count))

    def fail(
        self, *, method: str | None = None, path: str = "", status: int = 503, count: int = 1
    ) -> None:
        """The next ``count`` matching requests are answered ``status`` without forwarding."""
        self._add(_Rule("fail", method, re.compile(path), count, status))

    def clear(self) -> None:
        """Forget the log, the scripted faults, the rates and the outage."""
        with self._lock:
            self._log.clear()
            self._rules.clear()
            self._rates = dict.fromkeys(_RANDOM_OUTCOMES, 0.0)
            self._outage = False

    @property
    def log(self) -> list[Request]:
        with self._lock:
            return list(self._log)

    def outcomes(self, outcome: str) -> list[Request]:
        """The logged requests that got ``outcome``."""
        return [r for r in self.log if r.outcome == outcome]

    @property
    def pending_rules(self) -> int:
        """How many scripted faults have not been used yet."""
        with self._lock:
            return sum(rule.count for rule in self._rules)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FaultProxy is not running: use it as a context manager")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = http.server.ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals -----------------------------------------------------------------------------

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _decide(self, method: str, path: str) -> tuple[str, int]:
        with self._lock:
            if self._outage:
                outcome, status = "outage", 0
            else:
                outcome, status = "ok", 0
                for rule in self._rules:
                    if rule.matches(method, path):
                        rule.count -= 1
                        outcome, status = rule.outcome, rule.status
                        break
                else:
                    draw, edge = self._random.random(), 0.0
                    for name in _RANDOM_OUTCOMES:
                        edge += self._rates[name]
                        if draw < edge:
                            outcome = name
                            break
            self._log.append(Request(method, path, outcome))
            return outcome, status


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reset(self) -> None:
        """Close the client connection with a TCP reset, sending nothing more."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _send_error_document(self, status: int, code: str, extra: dict[str, str]) -> None:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f"<Error><Code>{code}</Code><Message>injected by FaultProxy</Message>"
            "<RequestId>faultproxy</RequestId></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        owner = self.owner
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        conn = http.client.HTTPConnection(owner.upstream_host, owner.upstream_port, timeout=120)
        try:
            send_body = body if body or self.command in {"PUT", "POST", "PATCH"} else None
            conn.request(self.command, self.path, body=send_body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            return response.status, response.reason, response.getheaders(), data
        finally:
            conn.close()

    def _relay(
        self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes, cut: bool
    ) -> None:
        self.send_response(status, reason)
        length = None
        for name, value in headers:
            lower = name.lower()
            if lower == "content-length":
                length = value
            if lower in _HOP_BY_HOP or lower in {"date", "server"}:
                continue
            self.send_header(name, value)
        if self.command == "HEAD":
            self.send_header("Content-Length", length if length is not None else "0")
        else:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if cut:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self._reset()
            return
        self.wfile.write(data)

    def _handle(self) -> None:
        owner = self.owner
        body = self._read_body()
        outcome, status = owner._decide(self.command, self.path)
        if outcome in {"reset", "outage"}:
            self._reset()
            return
        if outcome == "error":
            self._send_error_document(500, "InternalError", {})
            return
        if outcome == "slow_down":
            self._send_error_document(503, "SlowDown", {"Retry-After": str(owner.retry_after_s)})
            return
        if outcome == "fail":
            code = {500: "InternalError", 503: "SlowDown", 404: "NoSuchKey"}.get(status, "Error")
            self._send_error_document(status, code, {})
            return
        try:
            reply = self._forward(body)
        except OSError:
            self._reset()  # the upstream itself is unreachable: the client sees a reset
            return
        if outcome == "drop_reply":
            self._reset()
            return
        if outcome == "stall":
            time.sleep(owner.stall_s)
        cut = outcome == "truncate" and len(reply[3]) > 1
        try:
            self._relay(*reply, cut=cut)
        except OSError:
            self.close_connection = True  # the client gave up (e.g. its timeout during a stall)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle
