"""A TCP proxy that adds latency to every HTTP request, for measuring round trips on a local server.

    python benchmarks/latency_proxy.py --upstream http://127.0.0.1:5000 --delay-ms 30 [--port 0]

moto's S3 server on 127.0.0.1 answers in well under a millisecond, so a local benchmark cannot
show how many requests a save makes one after another; a real object store charges 20-100 ms
for each. This proxy listens on 127.0.0.1 (a free port unless ``--port``) and forwards bytes both
ways without any bandwidth limit, but holds the first bytes of every request for ``delay_ms``.
The extra time of an operation divided by the delay is then the number of its requests that
sat on the critical path one after another (its sequential round trips).

What exactly is delayed: per client connection, the first client->server read after the
connection opened or after the server sent response bytes, when that read starts with an HTTP
method token (``GET /...``, ``PUT /...``): that is one new request, counted and held back
``delay_ms`` before it is forwarded. The rest of a request (its body, read in further chunks)
and every server->client byte pass at once, so the delay is added once per request, like one
round trip of a far-away server. With HTTP keep-alive the connection is reused; requests on
different connections are delayed independently (in parallel). Not modelled: TCP and TLS
connection set-up (a real store charges one or two more round trips per new connection), and
a ``100 Continue`` interim response followed by the body (the body does not start with a
method, so it is not delayed again). Clients that pipeline requests are not supported (none of
fsspec's backends do).

From Python::

    with LatencyProxy("http://127.0.0.1:5000", delay_ms=30) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.url}, ...}
        ...
        proxy.requests  # requests seen since start or the last reset()
        proxy.peak_in_flight  # the most of them under way at once
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import heapq
import re
import signal
import threading
import time
import urllib.parse

__all__ = ["LatencyProxy"]

#: an HTTP/1.x request line's start: the method token, a space, and a target
_REQUEST_START = re.compile(rb"^[A-Z]{3,10} \S")
_CHUNK = 1 << 16
#: request lines kept for ``request_lines`` (the newest ones)
_LOGGED = 10_000


class LatencyProxy:
    """Forward 127.0.0.1:<port> to ``upstream``, holding each request ``delay_ms`` back.

    Used as a context manager: the proxy runs its own asyncio loop in a daemon thread, so the
    code under test (sync or async, in this process or in others) talks to ``url`` as to any
    server. ``delay_ms`` may be changed while it runs (it applies to requests from then on).
    ``requests`` and ``by_method`` count the requests seen since start or ``reset()``,
    ``request_lines`` says which they were, ``peak_in_flight`` how many were under way at
    once and ``longest_chain`` how many went out one after another.
    """

    def __init__(self, upstream: str, delay_ms: float = 0.0, port: int = 0) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(
                f"LatencyProxy upstream {upstream!r} is not a plain http://host:port URL: "
                "pass the server's endpoint, e.g. http://127.0.0.1:5000"
            )
        if delay_ms < 0:
            raise ValueError(f"LatencyProxy delay_ms={delay_ms} is negative: use 0 or more")
        self.upstream_host, self.upstream_port = parsed.hostname, parsed.port
        self.delay_ms = float(delay_ms)
        self._port = port
        self._lock = threading.Lock()
        self._requests = 0
        self._in_flight = 0
        self._peak_in_flight = 0
        self._by_method: collections.Counter[str] = collections.Counter()
        self._lines: collections.deque[str] = collections.deque(maxlen=_LOGGED)
        #: [seen, answered] monotonic times of each request (answered: inf until it is)
        self._spans: collections.deque[list[float]] = collections.deque(maxlen=_LOGGED)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -- counting ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The proxy's endpoint, to use in place of the upstream's."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> int:
        with self._lock:
            return self._requests

    @property
    def peak_in_flight(self) -> int:
        """The most requests that were under way at once (seen, not yet answered) since start
        or ``reset()``: 1 when a client sends its requests one after another. Concurrency is
        told apart from sequence for sure only where each request waits long enough (a
        ``delay_ms`` well above the client's time between sending two requests)."""
        with self._lock:
            return self._peak_in_flight

    @property
    def by_method(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_method)

    @property
    def longest_chain(self) -> int:
        """The most requests since start or ``reset()`` that went out one after another: the
        longest sequence in which each request was seen only after the one before it was
        answered. Sequential code makes a chain as long as its requests; requests sent
        together (under way at once) add one link; uploads in waves through a pool add one per
        wave. Unlike a time difference, this does not grow when the machine is busy, as long
        as requests sent together reach the proxy within ``delay_ms`` of each other."""
        with self._lock:
            spans = sorted((seen, answered) for seen, answered in self._spans)
        pending: list[tuple[float, int]] = []  # (answered, depth) of the requests seen so far
        done = longest = 0  # the longest chain among those answered before ``seen``, overall
        for seen, answered in spans:
            while pending and pending[0][0] <= seen:
                done = max(done, heapq.heappop(pending)[1])
            heapq.heappush(pending, (answered, done + 1))
            longest = max(longest, done + 1)
        return longest

    @property
    def request_lines(self) -> list[str]:
        """The request lines (``GET /bucket/key?query``) seen since start or ``reset()``, in
        order (the newest 10,000), to tell what kind of request each was."""
        with self._lock:
            return list(self._lines)

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._requests = 0
            self._peak_in_flight = self._in_flight
            self._by_method.clear()
            self._lines.clear()
            self._spans.clear()

    # -- running -------------------------------------------------------------------------------

    def start(self) -> LatencyProxy:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, "127.0.0.1", self._port)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="latency-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is None or server is None or self._thread is None:
            return

        async def close() -> None:
            server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)
        self._loop = self._server = self._thread = None

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- one connection ------------------------------------------------------------------------

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
        except OSError:
            client_w.close()
            return
        # True when the next request-looking client read is a new request: at the start and
        # after every response byte the server sent (one flag per connection, no pipelining).
        state: dict = {"new_request": True, "answered": True, "span": None}
        upstream = asyncio.ensure_future(self._client_to_server(client_r, server_w, state))
        downstream = asyncio.ensure_future(self._server_to_client(server_r, client_w, state))
        try:
            await asyncio.wait({upstream, downstream}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # stop(): the connection goes with the proxy
        finally:
            for task in (upstream, downstream):
                task.cancel()
            if not state["answered"]:  # the connection closed before the server answered
                with self._lock:
                    state["answered"] = True
                    self._in_flight -= 1
            for writer in (client_w, server_w):
                writer.close()

    async def _client_to_server(self, reader, writer, state: dict) -> None:
        while data := await reader.read(_CHUNK):
            if state["new_request"] and _REQUEST_START.match(data):
                state["new_request"] = False
                line = data.split(b"\r\n", 1)[0].decode("latin-1")
                method, _, rest = line.partition(" ")
                with self._lock:
                    self._requests += 1
                    self._in_flight += 1
                    self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
                    state["answered"] = False
                    state["span"] = [time.monotonic(), float("inf")]
                    self._spans.append(state["span"])
                    self._by_method[method] += 1
                    self._lines.append(f"{method} {rest.rsplit(' ', 1)[0]}")
                if self.delay_ms > 0:
                    await asyncio.sleep(self.delay_ms / 1000)
            writer.write(data)
            await writer.drain()

    async def _server_to_client(self, reader, writer, state: dict) -> None:
        while data := await reader.read(_CHUNK):
            state["new_request"] = True
            if not state["answered"]:
                with self._lock:
                    state["answered"] = True
                    state["span"][1] = time.monotonic()
                    self._in_flight -= 1
            writer.write(data)
            await writer.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the server, http://host:port")
    parser.add_argument("--delay-ms", type=float, default=30.0, help="added per request")
    parser.add_argument("--port", type=int, default=0, help="listen port (default: a free one)")
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with LatencyProxy(args.upstream, args.delay_ms, args.port) as proxy:
        print(f"{proxy.url} -> {args.upstream}, +{proxy.delay_ms:g} ms per request", flush=True)
        stop.wait()  # until Ctrl-C or SIGTERM, then say what went through
        print(f"{proxy.requests} requests: {proxy.by_method}")


if __name__ == "__main__":
    main()
