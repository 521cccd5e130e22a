"""Who may reach ``zephon ui``: loopback by default; any other address only when asked for
explicitly, and then every request must carry the token.

Two ASGI middlewares, outermost first:

- ``ReadOnlyMethods``: anything but GET and HEAD is answered 405 on every path, known or not,
  before routing, so no route can ever act on a request that writes.
- ``TokenGate``: with a token, a request needs it as ``Authorization: Bearer <token>`` or the
  ``zephon_ui_token`` cookie. ``?token=<token>`` in a URL sets that cookie and redirects to the
  same URL without it, so the token does not stay in the address bar, in history or in a
  shared link. Tokens are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac
import ipaddress
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = [
    "COOKIE",
    "MIN_TOKEN_LENGTH",
    "TOKEN_ENV",
    "ReadOnlyMethods",
    "TokenGate",
    "is_loopback",
]

TOKEN_ENV = "ZEPHON_UI_TOKEN"
COOKIE = "zephon_ui_token"
#: a shorter token is refused: it could be guessed over the network
MIN_TOKEN_LENGTH = 16

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def _plain(send: Send, status: int, text: str, headers: list[tuple[bytes, bytes]]) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ReadOnlyMethods:
    """405 for every method but GET and HEAD, on every path."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD"):
            await _plain(
                send,
                405,
                "zephon ui is read-only: only GET and HEAD are served\n",
                [(b"allow", b"GET, HEAD")],
            )
            return
        await self.app(scope, receive, send)


class TokenGate:
    """Requests must present ``token`` (see the module docstring); ``None``: no gate."""

    def __init__(self, app: App, token: str | None) -> None:
        self.app = app
        self._token = token.encode() if token else None

    def _matches(self, candidate: str | None) -> bool:
        assert self._token is not None
        return candidate is not None and hmac.compare_digest(candidate.encode(), self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._token is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        query = urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1"))
        given = [value for key, value in query if key == "token"]
        if given:
            if not self._matches(given[-1]):
                await _plain(send, 401, "zephon ui: wrong token\n", [])
                return
            rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "token"])
            location = scope["path"] + (f"?{rest}" if rest else "")
            cookie = f"{COOKIE}={given[-1]}; Path=/; HttpOnly; SameSite=Strict"
            await _plain(
                send,
                303,
                "",
                [(b"location", location.encode()), (b"set-cookie", cookie.encode("latin-1"))],
            )
            return
        bearer = headers.get("authorization", "")
        presented = bearer[len("Bearer ") :] if bearer.startswith("Bearer ") else None
        if presented is None:
            presented = _cookie(headers.get("cookie", ""))
        if not self._matches(presented):
            await _plain(
                send,
                401,
                "zephon ui: this server needs its token: open the URL with ?token=... once, "
                "or send Authorization: Bearer ...\n",
                [],
            )
            return
        await self.app(scope, receive, send)


def _cookie(header: str) -> str | None:
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None
