"""Run ``zephon ui``: check where it may listen, open the catalog read-only, bind, serve.

The socket is bound here, before uvicorn starts, so that a port in use is one line naming
the port (and port 0 picks a free one, whose number the start line prints). uvicorn's access
log stays off: a ``?token=`` URL must never reach a log.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading

from zephon.catalog import Catalog, CatalogError, mask_url
from zephon.errors import ConfigError, ZephonError
from zephon.ui.access import MIN_TOKEN_LENGTH, TOKEN_ENV, is_loopback

__all__ = ["AddressRefused", "access_token", "bind", "serve"]


class AddressRefused(ConfigError):
    """A ``--host`` the dashboard may not listen on as asked (``zephon ui`` exits 2)."""


def access_token(host: str, allow_remote: bool) -> str | None:
    """The token requests must carry: None on loopback; for any other ``host`` only with
    ``allow_remote`` and ``$ZEPHON_UI_TOKEN`` set (``ConfigError`` naming the fix
    otherwise). The token's value is never part of a message."""
    if is_loopback(host):
        return None
    if not allow_remote:
        raise AddressRefused(
            f"--host {host} is not a loopback address: the dashboard would be reachable from "
            f"other machines; add --allow-remote and set {TOKEN_ENV} to a secret of at least "
            f"{MIN_TOKEN_LENGTH} characters, or keep the default --host 127.0.0.1"
        )
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < MIN_TOKEN_LENGTH:
        raise AddressRefused(
            f"--allow-remote needs a secret in the environment variable {TOKEN_ENV}, at least "
            f"{MIN_TOKEN_LENGTH} characters long (now {'too short' if token else 'unset'}); "
            "make one with: python3 -c 'import secrets; print(secrets.token_urlsafe())'"
        )
    return token


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (one-line ``ZephonError`` if it cannot be had)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host} cannot be resolved ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ZephonError(
                f"port {port} on {host} is in use; pick another with --port (0: any free port)"
            ) from None
        raise ZephonError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --host/--port"
        ) from None
    return sock


def _warm(figures) -> None:
    """``figures.warm()``; a failure only leaves the pages to compute what they show."""
    with contextlib.suppress(CatalogError):
        figures.warm()


def serve(url: str, *, host: str, port: int, allow_remote: bool, refresh_s: int) -> None:
    """Serve the dashboard of the catalog at ``url`` until interrupted."""
    token = access_token(host, allow_remote)
    try:
        import uvicorn

        from zephon.ui.app import create_app
        from zephon.ui.figures import GoodputCache
    except ImportError as exc:
        raise ConfigError(f"zephon ui needs its extra ({exc}); pip install 'zephon[ui]'") from None
    catalog = Catalog(url, read_only=True)
    try:
        sock = bind(host, port)
        shown_host = f"[{host}]" if ":" in host else host
        where = f"http://{shown_host}:{sock.getsockname()[1]}/runs"
        sys.stdout.write(
            f"zephon ui: catalog {mask_url(url)} (read-only) at {where}"
            f"{' (token required)' if token else ''}; Ctrl-C stops\n"
        )
        sys.stdout.flush()
        figures = GoodputCache(catalog)
        # every run's goodput computed once in the background, so first views are fast too
        threading.Thread(target=_warm, args=(figures,), name="zephon-ui-warm", daemon=True).start()
        config = uvicorn.Config(
            create_app(catalog, refresh_s=refresh_s, token=token, figures=figures),
            log_level="warning",
            access_log=False,
            lifespan="off",
            server_header=False,
        )
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        catalog.close()
