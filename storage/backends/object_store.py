"""Object stores (S3, GCS): conditional-write markers, server-side prefix listings, chunked
uploads, batched deletes, and no directories."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, ClassVar

import fsspec.config
from fsspec.spec import AbstractFileSystem

from zephon.storage.backends.base import Backend, ListedFile, _listed
from zephon.storage.backends.native import (
    OPTION,
    POOL_CONNECTIONS,
    NativeClient,
    NativeWriter,
    native_client,
)

__all__ = ["DEFAULT_POOL_CONNECTIONS", "GCSBackend", "ObjectStoreBackend", "S3Backend"]

#: files an object store's writer uploads (or a reader fetches) at once by default
UPLOAD_WORKERS = 32
#: connections s3fs may keep open to S3 at once unless the user sets ``max_pool_connections``
#: (aiobotocore's default is 10): a commit uploads up to 32 files at once, and each waiting
#: upload holds a connection, so a pool of 10 makes 32 files take four waves of round trips.
#: The 8 beyond the uploads are for the requests a commit sends beside a full wave of them
#: (its fence re-check and payload listing), which would otherwise wait for a free one.
#: gcsfs needs nothing: its aiohttp connector allows 100 connections.
DEFAULT_POOL_CONNECTIONS = POOL_CONNECTIONS
#: botocore's own retries, unless the user configures them: none, since Zephon's policy
#: (``storage.retry``) tries every request again and botocore's would multiply with it
BOTOCORE_RETRIES = {"total_max_attempts": 1}
#: botocore's own checksums, unless the user configures them: only where S3 requires one.
#: Since botocore 1.36 it computes a CRC32 of every request body and checks one on every
#: reply; Zephon's CRC32C of each file (the manifest's, sent as ``x-amz-checksum-crc32c`` on
#: single PUTs) already covers the bytes, so the second pass is CPU spent for nothing.
BOTOCORE_CHECKSUMS = {
    "request_checksum_calculation": "when_required",
    "response_checksum_validation": "when_required",
}


def _native_choice(options: Mapping[str, Any]) -> dict[str, Any]:
    return {OPTION: options[OPTION]} if OPTION in options else {}


class ObjectStoreBackend(Backend):
    """A bucket of keys: one create-only PUT for the marker, one paged LIST per subtree,
    multipart uploads of ``part_size`` parts, deletes in batches (S3 DeleteObjects: 1,000 keys
    each, GCS batch: 100)."""

    exclusive_create = True
    server_side_prefix = True
    multipart_uploads = True
    server_side_copy = True
    default_workers: ClassVar[int] = UPLOAD_WORKERS

    def __init__(self, fs: AbstractFileSystem, protocol: str, **where: Any) -> None:
        super().__init__(fs, protocol, **where)
        #: the native data path for payload bytes (``storage.backends.native``), or None where
        #: they go through the fsspec filesystem
        self.native: NativeClient | None = self._native_client()

    def _native_client(self) -> NativeClient | None:
        return native_client(
            self.protocol,
            {**(getattr(self.fs, "storage_options", None) or {}), **_native_choice(self.options)},
            self.root.lstrip("/").split("/", 1)[0],
            self.retry,
        )

    def _native(self, path: str) -> NativeClient | None:
        """The native client if it serves ``path`` (a path in the location's bucket); in a
        child forked since it was made, none: the child keeps the fsspec path
        (``storage.backends.native``)."""
        native = self.native
        if native is None or path.lstrip("/").split("/", 1)[0] != native.bucket:
            return None
        if native.pid != os.getpid():
            native = self.native = self._native_client()
        return native

    # -- the payload: through the native client where there is one ----------------------------

    def _read_file(self, path: str) -> bytes:
        native = self._native(path)
        if native is not None:
            return native.read_file(path)
        return super()._read_file(path)

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        native = self._native(path)
        if native is not None:
            return native.read_range(path, start, end)
        return super()._read_range(path, start, end)

    def _read_range_into(self, path: str, start: int, buffer: Any) -> int:
        native = self._native(path)
        if native is not None:
            return native.read_range_into(path, start, memoryview(buffer).cast("B"))
        return super()._read_range_into(path, start, buffer)

    def _range_chunks(self, path: str, start: int, end: int) -> Iterator[memoryview]:
        native = self._native(path)
        if native is not None:
            return native.range_chunks(path, start, end)
        return super()._range_chunks(path, start, end)

    def _get_file(self, path: str, local_path: str) -> None:
        native = self._native(path)
        if native is not None:
            native.get_file(path, local_path)
            return
        super()._get_file(path, local_path)

    def _put_native(self, path: str, data: Any, part_size: int) -> bool:
        """Write ``data`` through the native client if there is one; whether it did."""
        native = self._native(path)
        if native is None:
            return False
        native.put(path, data, part_size, self.default_workers)
        self.fs.invalidate_cache(path)
        return True

    def _put_bytes(self, path: str, data: bytes, part_size: int) -> None:
        if not self._put_native(path, data, part_size):
            super()._put_bytes(path, data, part_size)

    def _put_buffer(self, path: str, data: Any, part_size: int, crc32c: str | None) -> None:
        if not self._put_native(path, data, part_size):
            super()._put_buffer(path, data, part_size, crc32c)

    def _open_write(self, path: str, part_size: int) -> IO[bytes]:
        native = self._native(path)
        if native is not None:
            return native.open_write(path, part_size, self.default_workers)
        return super()._open_write(path, part_size)

    def _discard_write(self, handle: IO[bytes]) -> None:
        if isinstance(handle, NativeWriter):  # an upload never completed publishes nothing
            handle.discard()
            return
        super()._discard_write(handle)

    # -- the control path: fsspec --------------------------------------------------------------

    @classmethod
    def default_options(cls, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
        """The options without ``native`` (Zephon's own, which the fsspec filesystem must not
        see: s3fs hands unknown options to botocore)."""
        options = dict(storage_options or {})
        options.pop(OPTION, None)
        return options

    def _list_files(self, path: str, *, prefix: str = "") -> list[ListedFile]:
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

    def _file_exists(self, path: str) -> bool:
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

    def _create_exclusive(self, path: str, data: bytes) -> None:
        # One create-only PUT: S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``; s3fs and
        # gcsfs send the precondition for ``mode="create"`` and turn the 412 into
        # ``FileExistsError``.
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
        options = super().default_options(storage_options)
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
        config_kwargs.setdefault("retries", dict(BOTOCORE_RETRIES))
        for name, value in BOTOCORE_CHECKSUMS.items():
            config_kwargs.setdefault(name, value)
        options["config_kwargs"] = config_kwargs
        return options

    def __init__(self, fs: AbstractFileSystem, protocol: str, **where: Any) -> None:
        super().__init__(fs, protocol, **where)
        # One policy: s3fs's own loop (5 tries within about two seconds, a class attribute,
        # not an option) would run inside every try of Zephon's. The instance is shared only
        # by locations opened with the same options, Zephon's defaults among them.
        fs.retries = 1

    def _read_file(self, path: str) -> bytes:
        if self._native(path) is not None:
            return super()._read_file(path)
        return self._read_small(path)

    def _put_buffer(self, path: str, data: Any, part_size: int, crc32c: str | None) -> None:
        view = memoryview(data).cast("B")
        if self._native(path) is not None or view.nbytes >= 2 * part_size or crc32c is None:
            super()._put_buffer(path, data, part_size, crc32c)
            return
        # One PUT carrying the CRC32C Zephon computed anyway: S3 checks it against the bytes
        # it received and refuses the object if they differ (botocore computes no CRC32).
        self.fs.pipe_file(
            path, view.tobytes(), ChecksumCRC32C=crc32c, **self.multipart_options(part_size)
        )

    def _put_bytes(self, path: str, data: bytes, part_size: int) -> None:
        if self._put_native(path, data, part_size):
            return
        if len(data) < 2 * part_size:  # one PUT
            self.fs.pipe_file(path, data, **self.multipart_options(part_size))
            return
        # In parts, each part tried again on its own: a failed part never sends the whole
        # file again.
        bucket, key, _ = self.fs.split_path(path)
        upload = self._request("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        where = {"Bucket": bucket, "Key": key, "UploadId": upload}

        def send_part(number: int) -> dict[str, Any]:
            body = data[(number - 1) * part_size : number * part_size]
            out = self._request("upload_part", PartNumber=number, Body=body, **where)
            return {"PartNumber": number, "ETag": out["ETag"]}

        count = -(-len(data) // part_size)
        workers = max(1, min(count, int(getattr(self.fs, "max_concurrency", 1) or 1)))
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="zephon-parts") as pool:
                parts = list(pool.map(send_part, range(1, count + 1)))
            send = functools.partial(
                self.fs.call_s3, "complete_multipart_upload", MultipartUpload={"Parts": parts}
            )
            self._complete(functools.partial(send, **where), bucket, key)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", **where)
            raise
        self.fs.invalidate_cache(path)

    def _open_write(self, path: str, part_size: int) -> IO[bytes]:
        """s3fs's buffered file, each of whose requests (the multipart upload's start, every
        part, its completion; or the one PUT of a small file) is tried again on its own; or
        the native client's file."""
        handle = super()._open_write(path, part_size)
        if isinstance(handle, NativeWriter):
            return handle
        bucket, key, _ = self.fs.split_path(path)
        send = handle._call_s3

        def call(method: str, *args: Any, **kwargs: Any) -> Any:
            if method == "complete_multipart_upload":
                return self._complete(functools.partial(send, method, *args, **kwargs), bucket, key)
            return self.retry.call(send, method, *args, **kwargs)

        # Every request of an S3File goes through its ``_call_s3``: tried again there, a part
        # is sent again alone, never the file.
        handle._call_s3 = call  # type: ignore[attr-defined]
        return handle

    def _request(self, method: str, **kwargs: Any) -> Any:
        return self.retry.call(self.fs.call_s3, method, **kwargs)

    def _complete(self, send: Callable[[], Any], bucket: str, key: str) -> Any:
        """Complete a multipart upload, tried again; a retry that finds the upload gone
        (``NoSuchUpload``) while the object is there means the first try completed it and
        only its reply was lost."""
        tries = 0

        def attempt() -> Any:
            nonlocal tries
            tries += 1
            try:
                return send()
            except FileNotFoundError:
                if tries == 1:
                    raise
                self.fs.call_s3("head_object", Bucket=bucket, Key=key)  # or FileNotFoundError
                return {}

        return self.retry.call(attempt)

    def _read_small(self, path: str) -> bytes:
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
