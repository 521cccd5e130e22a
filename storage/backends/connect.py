"""Opening the fsspec filesystem of a URL: the one call outside the backend classes' methods
that reaches fsspec, with its failures translated here, before any backend exists
(``storage.location.open_location`` turns the result into a ``Location``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from zephon.storage.backends.registry import backend_for, package_for
from zephon.storage.errors import (
    BackendUnavailableError,
    InvalidNameError,
    StorageOptionsRefusedError,
)
from zephon.storage.redact import redact

__all__ = ["open_filesystem"]


def open_filesystem(
    url: str,
    protocol: str,
    storage_options: Mapping[str, Any] | None,
    masked: str,
    secrets: set[str] | frozenset[str],
) -> tuple[AbstractFileSystem, str]:
    """fsspec's filesystem for ``url`` (of ``protocol``) with ``storage_options`` (and the
    backend's defaults) and the path inside it; a missing
    package, a URL it cannot parse or options it refuses raise the ``StorageError`` naming
    ``masked`` (the URL with credentials masked) and the fix."""
    try:
        options = backend_for(protocol).default_options(storage_options)
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        package = package_for(protocol)
        raise BackendUnavailableError(
            f"cannot open {masked}: the {protocol}:// backend needs {package}; "
            f"install it with `pip install {package}`"
            if package is not None
            else f"cannot open {masked}: {redact(exc, secrets)}",
            url=masked,
        ) from exc
    except ValueError as exc:
        needed = backend_for(protocol).options_needed
        if needed is not None:
            raise StorageOptionsRefusedError(
                f"cannot open {masked}: {redact(exc, secrets)}; {needed}", url=masked
            ) from exc
        raise InvalidNameError(
            f"cannot open {masked}: {redact(exc, secrets)}; check the URL's protocol", url=masked
        ) from exc
    except Exception as exc:  # fsspec backends fail in many ways on a URL they cannot open
        what = f"cannot open {masked}: {type(exc).__name__}: {redact(exc, secrets)}"
        if isinstance(exc, TypeError | AttributeError | KeyError):  # options it cannot take
            raise StorageOptionsRefusedError(what, url=masked) from exc
        raise BackendUnavailableError(
            f"{what}; check the URL and storage_options, and that the endpoint is reachable",
            url=masked,
        ) from exc
