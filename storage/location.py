"""Turning a user's URL or path into an fsspec filesystem and a root path inside it.

A ``Location`` is the only place that knows how a URL maps to fsspec: everything else in the
storage layer works on plain ``str`` paths in the filesystem's own form (``bucket/prefix/x``
for object stores, ``/abs/path`` for local disk). Paths are ``str``, never ``pathlib``, since
``pathlib`` mangles ``s3://``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import fsspec
from fsspec.spec import AbstractFileSystem

from storage.errors import BackendUnavailableError, InvalidNameError

__all__ = ["Location", "open_location", "mask_url", "protocol_of"]

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
_SECRET_QUERY_KEYS = re.compile(r"(key|secret|token|password|signature|credential)", re.I)


def mask_url(url: str) -> str:
    """The URL with any password or secret-bearing query value replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"{user}@{host}"
    query = parts.query
    if query:
        pairs = [(k, "***" if _SECRET_QUERY_KEYS.search(k) else v) for k, v in parse_qsl(query)]
        query = urlencode(pairs, safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def protocol_of(url: str) -> str:
    """The fsspec protocol of a URL; plain paths are ``file``."""
    if "://" not in url:
        return "file"
    return url.split("://", 1)[0].lower()


@dataclass(frozen=True)
class Location:
    """A filesystem and a root directory in it, resolved once from a URL."""

    fs: AbstractFileSystem
    root: str
    protocol: str
    url: str  # as the user gave it, credentials masked: the form used in every message

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
        return (
            f"{self.protocol}://{path.lstrip('/')}"
            if self.protocol != "memory"
            else (f"memory://{path}")
        )


def open_location(url: str, storage_options: dict | None = None) -> Location:
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
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        package = _PROTOCOL_PACKAGES.get(protocol, f"the fsspec implementation of {protocol}://")
        raise BackendUnavailableError(
            f"cannot open {masked}: the {protocol}:// backend needs {package}; "
            f"install it with `pip install {package}`"
            if protocol in _PROTOCOL_PACKAGES
            else f"cannot open {masked}: {exc}",
            url=masked,
        ) from exc
    except ValueError as exc:
        raise InvalidNameError(
            f"cannot open {masked}: {exc}; check the URL's protocol", url=masked
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
    return Location(fs=fs, root=root, protocol=fs_protocol, url=masked)
