"""Object stores (S3, GCS): conditional-write markers, server-side prefix listings, chunked
uploads, batched deletes, and no directories."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import fsspec.config

from storage.backends.base import Backend, ListedFile, _listed

__all__ = ["DEFAULT_POOL_CONNECTIONS", "GCSBackend", "ObjectStoreBackend", "S3Backend"]

#: connections s3fs may keep open to S3 at once unless the user sets ``max_pool_connections``
#: (aiobotocore's default is 10): a commit uploads up to 32 files at once, and each waiting
#: upload holds a connection, so a pool of 10 makes 32 files take four waves of round trips.
#: gcsfs needs nothing: its aiohttp connector allows 100 connections.
DEFAULT_POOL_CONNECTIONS = 32


class ObjectStoreBackend(Backend):
    """A bucket of keys: one create-only PUT for the marker, one paged LIST per subtree,
    multipart uploads of ``part_size`` parts, deletes in batches (S3 DeleteObjects: 1,000 keys
    each, GCS batch: 100)."""

    exclusive_create = True
    server_side_prefix = True
    multipart_uploads = True
    default_workers: ClassVar[int] = DEFAULT_POOL_CONNECTIONS

    def list_files(self, path: str, *, prefix: str = "") -> list[ListedFile]:
        try:
            if prefix:  # only keys under <path>/<prefix>..., filtered by the server
                found = self.fs.find(path, detail=True, withdirs=False, prefix=prefix)
            else:
                # Listing <parent> with prefix "<name>/" is one paged LIST; listing <path>
                # itself would add a HEAD and a second LIST whenever the directory is empty.
                parent, _, name = path.rstrip("/").rpartition("/")
                found = self.fs.find(parent, detail=True, withdirs=False, prefix=f"{name}/")
        except FileNotFoundError:
            return []
        return _listed(found)

    def file_exists(self, path: str) -> bool:
        # One LIST of the key as a prefix: s3fs's ``exists`` follows a missing key's HEAD with
        # a LIST to see whether it is a directory.
        parent, _, name = path.rpartition("/")
        try:
            return path in self.fs.find(parent, prefix=name, withdirs=False)
        except FileNotFoundError:
            return False

    def multipart_options(self, part_size: int) -> dict[str, Any]:
        # s3fs sends the parts of a multipart upload concurrently; gcsfs uploads resumably.
        return {"chunksize": part_size}

    def create_exclusive(self, path: str, data: bytes) -> None:
        """One create-only PUT: S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``; s3fs
        and gcsfs send the precondition for ``mode="create"`` and turn the 412 into
        ``FileExistsError``."""
        self.fs.pipe_file(path, data, mode="create")


class S3Backend(ObjectStoreBackend):
    """S3 and S3-compatible stores through s3fs."""

    protocols = ("s3", "s3a")
    package = "s3fs"
    url_credentials_go_in = "key, secret and token"

    @classmethod
    def default_options(cls, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
        """A connection pool of ``DEFAULT_POOL_CONNECTIONS``
        (``config_kwargs.max_pool_connections``) unless the user set one.

        What the user set always wins, in the options or in fsspec's own configuration
        (``FSSPEC_S3_CONFIG_KWARGS``, fsspec config files), which ``url_to_fs`` merges only
        one level deep: a ``config_kwargs`` passed here would hide the configured one, so it
        is merged in. A botocore ``Config`` object in ``client_kwargs`` is the user's whole
        configuration and is left alone.
        """
        options = dict(storage_options or {})
        configured: dict[str, Any] = {}
        for name in sorted(cls.protocols):  # s3fs takes the configuration of both protocols
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

    def read_small(self, path: str) -> bytes:
        # s3fs releases that take ``max_concurrency`` would otherwise HEAD first to decide
        # whether to download in concurrent ranges (older ones, such as the 2026.2 that
        # ``datasets`` pins, do one GET anyway).
        if _takes_max_concurrency(type(self.fs)):
            return self.fs.cat_file(path, max_concurrency=1)
        return self.fs.cat_file(path)


@functools.cache
def _takes_max_concurrency(filesystem: type) -> bool:
    method = getattr(filesystem, "_cat_file", None) or filesystem.cat_file
    try:
        return "max_concurrency" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


class GCSBackend(ObjectStoreBackend):
    """Google Cloud Storage through gcsfs."""

    protocols = ("gs", "gcs")
    package = "gcsfs"
    url_credentials_go_in = "token (a credentials file, or its parsed JSON)"
