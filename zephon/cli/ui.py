"""``zephon ui``: serve the read-only dashboard of the catalog (``zephon.ui``, docs/ui.md).

Imported only when the command runs; the web stack (the ``ui`` extra) only after the
arguments and the address were checked, so a refused ``--host`` needs none of it."""

from __future__ import annotations

import argparse

from zephon.cli import EXIT_OK

__all__ = ["cmd_ui", "register"]


def register(add) -> None:
    """Add ``zephon ui`` to the parser (``add`` as in ``zephon.cli.build_parser``)."""
    from zephon.cli import _command, count_between

    p = add(
        "ui",
        _command("cmd_ui", "zephon.cli.ui"),
        "serve a read-only web dashboard of the catalog (runs, save timelines, attempts)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only); any other needs "
        "--allow-remote and $ZEPHON_UI_TOKEN",
    )
    p.add_argument(
        "--port", type=count_between(0, 65535), default=8765, help="port (default 8765; 0: any)"
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host; every request must then carry $ZEPHON_UI_TOKEN",
    )
    p.add_argument(
        "--refresh",
        type=count_between(0, 3600),
        default=5,
        metavar="SECONDS",
        help="pages refresh themselves this often (default 5; 0: never)",
    )


def cmd_ui(args: argparse.Namespace) -> int:
    from zephon.cli import EXIT_USAGE, _fail
    from zephon.locations import resolve_catalog_url
    from zephon.ui.server import AddressRefused, serve

    try:
        serve(
            resolve_catalog_url(args.catalog),
            host=args.host,
            port=args.port,
            allow_remote=args.allow_remote,
            refresh_s=args.refresh,
        )
    except AddressRefused as exc:  # a refused --host is a usage error: nothing was opened
        return _fail(exc, EXIT_USAGE)
    except KeyboardInterrupt:  # Ctrl-C is how a server is stopped: not an error
        pass
    return EXIT_OK
