"""Turning a user's URL or path into an fsspec filesystem and a root path inside it.

A ``Location`` is the only place that knows how a URL maps to fsspec: everything else in the
storage layer works on plain ``str`` paths in the filesystem's own form (``bucket/prefix/x``
for object stores, ``/abs/path`` for local disk). Paths are ``str``, never ``pathlib``, since
``pathlib`` mangles ``s3://``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import fsspec
import fsspec.config
from fsspec.spec import AbstractFileSystem

from storage.errors import BackendUnavailableError, InvalidNameError, StorageOptionsRefusedError
from storage.redact import is_secret_name, mask_url, option_secrets, redact, secrets_in

__all__ = [
    "DEFAULT_POOL_CONNECTIONS",
    "Location",
    "open_location",
    "mask_url",
    "protocol_of",
    "with_defaults",
]

# Packages that provide fsspec protocols, for an install hint when one is missing.
_PROTOCOL_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "hf": "huggingface_hub",
    "sftp": "paramiko",
    "ssh": "paramiko",
    "hdfs": "pyarrow",
    "webhdfs": "requests",
    "oci": "ocifs",
    "oss": "ossfs",
}
#: object stores whose fsspec backends read no credentials from the URL (a "user:pw@" there
#: becomes part of the bucket name, a "?secret=" part of the key, so both are refused), with
#: the storage options that take them instead
_NO_URL_CREDENTIALS = {
    "s3": "key, secret and token",
    "s3a": "key, secret and token",
    "gs": "token (a credentials file, or its parsed JSON)",
    "gcs": "token (a credentials file, or its parsed JSON)",
}


#: connections s3fs may keep open to S3 at once unless the user sets ``max_pool_connections``
#: (aiobotocore's default is 10): a commit uploads up to 32 files at once, and each waiting
#: upload holds a connection, so a pool of 10 makes 32 files take four waves of round trips.
#: gcsfs needs nothing: its aiohttp connector allows 100 connections.
DEFAULT_POOL_CONNECTIONS = 32
_POOLED = {"s3", "s3a"}


def protocol_of(url: str) -> str:
    """The fsspec protocol of a URL; plain paths are ``file``."""
    if "://" not in url:
        return "file"
    return url.split("://", 1)[0].lower()


@dataclass(frozen=True, repr=False)
class Location:
    """A filesystem and a root directory in it, resolved once from a URL."""

    fs: AbstractFileSystem
    root: str
    protocol: str
    url: str  # as the user gave it, credentials masked: the form used in every message
    #: credential values from the URL and storage_options, scrubbed from backend error texts
    secrets: frozenset[str] = field(default=frozenset(), compare=False)

    def __repr__(self) -> str:
        # Never the filesystem: its attributes (and some backends' reprs) hold the credentials.
        return f"Location({self.url!r}, protocol={self.protocol!r})"

    @property
    def is_local(self) -> bool:
        return self.protocol in {"file", "local"}

    @property
    def canonical_url(self) -> str:
        """The root as a full URL that reopens to the same place from any working directory
        (local paths made absolute); credential-free, so it may be stored in a catalog."""
        return self.display(self.root)

    def join(self, *parts: str) -> str:
        """A path under the root, in the filesystem's own form."""
        pieces = [self.root.rstrip("/")] + [p.strip("/") for p in parts if p]
        return "/".join(pieces) if pieces[0] else "/".join(pieces[1:])

    def display(self, path: str) -> str:
        """A full, credential-free URL for a path of this filesystem, for messages."""
        if self.is_local:
            return path
        if "://" in path:  # HTTP keeps whole URLs as paths
            return mask_url(path)
        if self.protocol == "memory":
            return f"memory://{path}"
        return mask_url(f"{self.protocol}://{path.lstrip('/')}")


def _refuse_url_credentials(url: str, protocol: str, masked: str) -> None:
    """Object-store URLs carry no credentials: say where they go instead of sending them on
    as part of a bucket or key name (and into every listing error and catalog row)."""
    if protocol not in _NO_URL_CREDENTIALS:
        return
    authority = url.split("://", 1)[-1].split("?", 1)[0].split("#", 1)[0]
    try:
        query = urlsplit(url).query
    except ValueError:
        query = ""
    secret_names = [n for n, _ in parse_qsl(query, keep_blank_values=True) if is_secret_name(n)]
    # masked != url also catches a password whose "/" ends the authority early: K:a/b@bucket
    if "@" not in authority.split("/", 1)[0] and masked == url:
        return
    if secret_names:
        where = f"?{secret_names[0]}="
    else:
        where = "a user:password@ part" if ":" in authority.split("@", 1)[0] else "a user@ part"
    raise InvalidNameError(
        f"{masked} carries credentials in the URL ({where}), which {protocol}:// does not "
        f"read; remove them from the URL and pass them in storage_options as "
        f"{_NO_URL_CREDENTIALS[protocol]}, or use the backend's environment variables",
        url=masked,
    )


def with_defaults(protocol: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` with Zephon's defaults added where the user set nothing: on S3, a
    connection pool of ``DEFAULT_POOL_CONNECTIONS`` (``config_kwargs.max_pool_connections``).

    What the user set always wins, in the options or in fsspec's own configuration
    (``FSSPEC_S3_CONFIG_KWARGS``, fsspec config files), which ``url_to_fs`` merges only one
    level deep: a ``config_kwargs`` passed here would hide the configured one, so it is merged
    in. A botocore ``Config`` object in ``client_kwargs`` is the user's whole configuration
    and is left alone.
    """
    options = dict(storage_options or {})
    if protocol not in _POOLED:
        return options
    configured: dict[str, Any] = {}
    for name in sorted(_POOLED):  # s3fs takes the configuration of both its protocols
        configured.update(fsspec.config.conf.get(name) or {})
    client_kwargs = {
        **(configured.get("client_kwargs") or {}),
        **(options.get("client_kwargs") or {}),
    }
    if "config" in client_kwargs:
        return options
    config_kwargs = {
        **(configured.get("config_kwargs") or {}),
        **(options.get("config_kwargs") or {}),
    }
    config_kwargs.setdefault("max_pool_connections", DEFAULT_POOL_CONNECTIONS)
    options["config_kwargs"] = config_kwargs
    return options


def open_location(url: str, storage_options: Mapping[str, Any] | None = None) -> Location:
    """Resolve ``url`` (any fsspec URL or plain path) to a ``Location``.

    Raises ``BackendUnavailableError`` naming the package to install when the protocol's
    implementation is missing, and ``InvalidNameError`` for an empty or chained URL.
    """
    if not isinstance(url, str) or not url.strip():
        raise InvalidNameError(
            f"storage URL must be a non-empty string such as /data/ckpt or s3://bucket/ckpt, "
            f"got {url!r}"
        )
    if "::" in url:
        raise InvalidNameError(
            f"chained fsspec URLs are not supported for checkpoints: {mask_url(url)}; "
            "pass a single URL and put backend settings in storage_options",
            url=mask_url(url),
        )
    masked = mask_url(url)
    protocol = protocol_of(url)
    _refuse_url_credentials(url, protocol, masked)
    secrets = secrets_in(url) | option_secrets(storage_options)
    try:
        fs, root = fsspec.core.url_to_fs(url, **with_defaults(protocol, storage_options))
    except ImportError as exc:
        package = _PROTOCOL_PACKAGES.get(protocol, f"the fsspec implementation of {protocol}://")
        raise BackendUnavailableError(
            f"cannot open {masked}: the {protocol}:// backend needs {package}; "
            f"install it with `pip install {package}`"
            if protocol in _PROTOCOL_PACKAGES
            else f"cannot open {masked}: {redact(exc, secrets)}",
            url=masked,
        ) from exc
    except ValueError as exc:
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
    fs_protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if fs_protocol in {"file", "local"}:
        root = fs._strip_protocol(root)
    root = root.rstrip("/") or root
    if not root or root == "/" and fs_protocol not in {"file", "local"}:
        raise InvalidNameError(
            f"{masked} names no bucket or directory; use e.g. s3://bucket/checkpoints",
            url=masked,
        )
    return Location(fs=fs, root=root, protocol=fs_protocol, url=masked, secrets=secrets)
