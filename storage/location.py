"""Turning a user's URL or path into an fsspec filesystem and a root path inside it.

A ``Location`` is the only place that knows how a URL maps to a filesystem (which it asks the
backend classes to open, ``storage.backends.connect``): everything else in the storage layer
works on plain ``str`` paths in the filesystem's own form (``bucket/prefix/x``
for object stores, ``/abs/path`` for local disk). Paths are ``str``, never ``pathlib``, since
``pathlib`` mangles ``s3://``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from zephon.storage.backends import DEFAULT_POOL_CONNECTIONS, Backend, backend_for
from zephon.storage.backends.connect import open_filesystem
from zephon.storage.errors import InvalidNameError
from zephon.storage.layout import CHUNK_DIR, RunLayout
from zephon.storage.redact import (
    environment_secrets,
    is_secret_name,
    mask_url,
    option_secrets,
    secrets_in,
)
from zephon.storage.retry import DEFAULT_RETRY, RetryPolicy

if TYPE_CHECKING:
    from fsspec.spec import AbstractFileSystem

__all__ = [
    "DEFAULT_POOL_CONNECTIONS",
    "Location",
    "open_location",
    "mask_url",
    "protocol_of",
    "with_defaults",
]


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
    #: the backend family's primitives and capability flags (``storage.backends``), chosen
    #: once from the filesystem's protocol
    backend: Backend = field(compare=False)
    #: credential values from the URL and storage_options, scrubbed from backend error texts
    secrets: frozenset[str] = field(default=frozenset(), compare=False)
    #: the setting the user named this location with ("local_dir"), so that a message's fix
    #: names what to change; None: a location without one (the fix names the location only)
    role: str | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        # Never the filesystem: its attributes (and some backends' reprs) hold the credentials.
        return f"Location({self.url!r}, protocol={self.protocol!r})"

    @property
    def canonical_url(self) -> str:
        """The root as a full URL that reopens to the same place from any working directory
        (local paths made absolute); credential-free, so it may be stored in a catalog."""
        return self.display(self.root)

    @property
    def retry(self) -> RetryPolicy:
        """How transient backend failures are tried again here (``storage.retry``)."""
        return self.backend.retry

    def join(self, *parts: str) -> str:
        """A path under the root, in the filesystem's own form."""
        pieces = [self.root.rstrip("/")] + [p.strip("/") for p in parts if p]
        return "/".join(pieces) if pieces[0] else "/".join(pieces[1:])

    def display(self, path: str) -> str:
        """A full, credential-free URL for a path of this filesystem, for messages."""
        return self.backend.display(path)

    def chunk_dir(self, scope: str, run: str | None) -> str:
        """The chunk directory of a deduplicated save of ``run`` in ``scope`` (``run``: its
        run's ``_chunks``; ``save_dir``: the root's, shared by every run; the inference
        layout's run directory is the root, so both are the root's there)."""
        if scope == "save_dir":
            return self.join(CHUNK_DIR)
        return self.run_layout(run).chunk_dir

    def run_layout(self, run: str | None) -> RunLayout:
        """The paths of run ``run`` under the root (``None``: the inference layout, straight
        under the root). ``InvalidNameError`` for a name the layout refuses."""
        return RunLayout(run, self.join(run) if run is not None else self.root)


def _refuse_url_credentials(url: str, protocol: str, masked: str) -> None:
    """Object-store URLs carry no credentials: say where they go instead of sending them on
    as part of a bucket or key name (and into every listing error and catalog row)."""
    takes = backend_for(protocol).url_credentials_go_in
    if takes is None:
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
        f"{takes}, or use the backend's environment variables",
        url=masked,
    )


def with_defaults(protocol: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` with the defaults of ``protocol``'s backend added where the user set
    nothing (on S3, a connection pool of ``DEFAULT_POOL_CONNECTIONS``: see
    ``storage.backends.S3Backend.default_options``)."""
    return backend_for(protocol).default_options(storage_options)


def open_location(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    role: str | None = None,
    retry: RetryPolicy | None = None,
) -> Location:
    """Resolve ``url`` (any fsspec URL or plain path) to a ``Location``; ``role`` names the
    setting it came from ("local_dir") in the fixes of its messages. Every backend primitive
    there tries transient failures again under ``retry`` (default:
    ``storage.retry.DEFAULT_RETRY``).

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
    secrets |= environment_secrets(backend_for(protocol).secret_environment)
    fs, root = open_filesystem(url, protocol, storage_options, masked, secrets)
    fs_protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    backend_class = backend_for(fs_protocol)
    root = backend_class.normalise_root(fs, root)
    root = root.rstrip("/") or root
    if not root or root == "/" and not backend_class.posix_paths:
        raise InvalidNameError(
            f"{masked} names no bucket or directory; use e.g. s3://bucket/checkpoints",
            url=masked,
        )
    return Location(
        fs=fs,
        root=root,
        protocol=fs_protocol,
        url=masked,
        backend=backend_class(
            fs,
            fs_protocol,
            retry=retry or DEFAULT_RETRY,
            root=root,
            url=masked,
            secrets=secrets,
            role=role,
            options=storage_options,
        ),
        secrets=secrets,
        role=role,
    )
