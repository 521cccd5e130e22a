"""The boundary every subcommand runs inside (torch ones too): what the layers below raise on
purpose prints as one line with its layer's exit code.

Storage and catalog translate the failures of what they call once, where they call it (the
storage backends: ``storage.backends.translate``; the catalog: ``catalog.engine``), into
errors that carry the URL they are about (masked). The one thing left for the boundary is to
name where a storage option the backend refused came from (the flag or the environment
variable). Anything else that escapes is a bug of ours and stays one: exit 70, its traceback
with ``ZEPHON_DEBUG=1`` (``zephon.cli.main``).
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable

from zephon.locations import STORAGE_OPTIONS_ENV
from zephon.storage import BackendUnavailableError, StorageOptionsRefusedError

__all__ = ["at_boundary", "refused_options_fix"]


def at_boundary(handler: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """``handler`` with a refusal of the storage options naming where they came from."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except StorageOptionsRefusedError as exc:
            raise BackendUnavailableError(
                f"{exc.what}; {refused_options_fix(args)}", url=exc.url
            ) from exc

    return run


def refused_options_fix(args: argparse.Namespace) -> str:
    """The fix for a backend that refused what it was given, naming where its options came
    from (the flag, the environment variable, or neither)."""
    if getattr(args, "storage_options", None) is not None:
        source = "--storage-options"
    elif os.environ.get(STORAGE_OPTIONS_ENV):
        source = f"${STORAGE_OPTIONS_ENV}"
    else:
        return (
            "the backend refused it: check the URL, and pass what the backend needs in "
            "--storage-options"
        )
    return f"the backend refused it or its storage options: check the URL and fix {source}"
