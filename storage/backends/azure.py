"""Azure Blob Storage through adlfs (``az://``, ``abfs://``, ``abfss://``): an object store
whose marker is one ``Put Blob`` with ``If-None-Match: *``.

adlfs is asynchronous; the calls here that adlfs has no single-request form of (a listing
without the extra ``HEAD`` adlfs's ``find`` sends first, a one-``HEAD`` existence check, a
batched delete, a block upload whose blocks are tried again one by one) go to the Azure SDK
client adlfs made (``fs.service_client``), on adlfs's own event loop. Errors are the SDK's
(``azure.core.exceptions``); ``storage.backends.translate`` turns them into the answers and
``StorageError``s every backend gives, and ``storage.retry`` classifies them.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, ClassVar, TypeVar

from fsspec.asyn import sync
from fsspec.spec import AbstractFileSystem

from zephon.storage.backends.base import ListedFile, mtime_of
from zephon.storage.backends.object_store import DEFAULT_POOL_CONNECTIONS, ObjectStoreBackend
from zephon.storage.redact import mask_url

__all__ = ["AzureBackend"]

T = TypeVar("T")

#: blobs deleted at once (``_delete_batch``): one wave of requests over adlfs's connections
DELETE_BATCH = 256


class AzureBackend(ObjectStoreBackend):
    """Azure Blob Storage (and ADLS Gen2 accounts) through adlfs.

    Marker: ``upload_blob(overwrite=False)``, which the SDK sends as ``Put Blob`` with
    ``If-None-Match: *``; the service answers 409 ``BlobAlreadyExists`` (the SDK turns a 412
    ``ConditionNotMet`` into the same), adlfs raises ``FileExistsError``. Listings filter by
    prefix on the server (``List Blobs`` with ``prefix``, paged); deletes go out at once, one
    ``Delete Blob`` per file, in waves of 256; files of two parts or more, whole or streamed,
    are staged as ``part_size`` blocks, each tried again on its own, and committed with one
    ``Put Block List``.
    """

    protocols = ("abfs", "az", "abfss")
    package = "adlfs"
    bucket_word: ClassVar[str] = "container"
    options_needed = (
        "adlfs needs the account: storage_options connection_string, or account_name with "
        "account_key, sas_token or a service principal (or the AZURE_STORAGE_* environment "
        "variables of the same names)"
    )
    secret_environment = (
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_STORAGE_CLIENT_SECRET",
    )

    def __init__(self, fs: AbstractFileSystem, protocol: str, **where: Any) -> None:
        super().__init__(fs, protocol, **where)
        # One policy: the SDK's own ExponentialRetry (3 retries, after about 15, 18 and 24 s)
        # would run inside every try of Zephon's. Every client adlfs derives from its service client
        # (containers, blobs, the file handles) shares the service client's policy objects.
        config = getattr(getattr(fs, "service_client", None), "_config", None)
        policy = getattr(config, "retry_policy", None)
        if policy is not None and hasattr(policy, "total_retries"):
            policy.total_retries = 0

    def display(self, path: str) -> str:
        # adlfs answers to az://, abfs:// and abfss:// alike and calls itself abfs: name paths
        # with the scheme the user's URL has, as the user wrote it.
        scheme = self.url.split("://", 1)[0].lower() if "://" in self.url else ""
        if scheme in self.protocols and "://" not in path:
            return mask_url(f"{scheme}://{path.lstrip('/')}")
        return super().display(path)

    def _call(self, container: str, use: Callable[[Any], Awaitable[T]]) -> T:
        """``use(container_client)`` on adlfs's event loop."""

        async def run() -> T:
            return await use(self.fs.service_client.get_container_client(container))

        return sync(self.fs.loop, run)

    def _split(self, path: str) -> tuple[str, str]:
        container, key, _ = self.fs.split_path(path)
        return container, key

    def _list_files(self, path: str, *, prefix: str = "") -> list[ListedFile]:
        container, key = self._split(path)
        start = f"{key.rstrip('/')}/{prefix}" if key else prefix

        async def listing(client: Any) -> list[ListedFile]:
            found = []
            async for blob in client.list_blobs(name_starts_with=start, include=["metadata"]):
                if (blob.metadata or {}).get("is_directory") == "true":  # adlfs's mkdir
                    continue
                info = {"LastModified": blob.last_modified}
                found.append(ListedFile(f"{container}/{blob.name}", blob.size, mtime_of(info)))
            return found

        try:
            return self._call(container, listing)
        except Exception as exc:
            if getattr(exc, "status_code", None) == 404:  # no container: nothing below
                return []
            raise

    def _file_exists(self, path: str) -> bool:
        # One HEAD (Get Blob Properties): adlfs's ``isfile`` lists when the HEAD finds nothing.
        container, key = self._split(path)
        return self._call(container, lambda client: client.get_blob_client(key).exists())

    def multipart_options(self, part_size: int) -> dict[str, Any]:
        # The blocks of a staged upload (``_put_bytes``; ``open(..., block_size=)`` for
        # streamed files): adlfs's ``pipe_file`` takes no part size of its own.
        return {"block_size": part_size}

    def _put_bytes(self, path: str, data: bytes, part_size: int) -> None:
        if self._put_native(path, data, part_size):
            return
        if len(data) < 2 * part_size:  # one Put Blob
            self.fs.pipe_file(path, data)
            return
        # In blocks, each tried again on its own, then one Put Block List: a failed block is
        # sent again alone, never the whole file. Uncommitted blocks of an upload that fails
        # are discarded by the service (after a week, or with the next commit of the blob).
        count = -(-len(data) // part_size)
        ids = [new_block_id() for _ in range(count)]

        def stage(number: int) -> None:
            self.stage_block(path, ids[number], data[number * part_size : (number + 1) * part_size])

        workers = max(1, min(count, DEFAULT_POOL_CONNECTIONS))
        with ThreadPoolExecutor(workers, thread_name_prefix="zephon-blocks") as pool:
            list(pool.map(stage, range(count)))
        self.commit_blocks(path, ids)

    def stage_block(self, path: str, block_id: str, body: bytes) -> None:
        """Upload one uncommitted block of ``path`` (``Put Block``), tried again on its own."""
        container, key = self._split(path)

        def send() -> None:
            blob = self.fs.service_client.get_blob_client(container, key)
            sync(self.fs.loop, blob.stage_block, block_id, body)

        self.retry.call(send)

    def commit_blocks(self, path: str, ids: list[str]) -> None:
        """Make ``path`` the blocks ``ids`` in order (``Put Block List``), tried again: the same
        list committed again after a lost reply gives the same blob."""
        container, key = self._split(path)

        def send() -> None:
            blob = self.fs.service_client.get_blob_client(container, key)
            sync(self.fs.loop, blob.commit_block_list, ids)

        self.retry.call(send)
        self.fs.invalidate_cache(path)

    def _open_write(self, path: str, part_size: int) -> IO[bytes]:
        """A file that stages a block of ``part_size`` whenever one is full, each tried again
        on its own, and commits them on close (a file of one part: one ``Put Blob``). adlfs's
        own file would stage them too, but through no retry policy. Or the native client's
        file (``storage.backends.native``)."""
        if self._native(path) is not None:
            return super()._open_write(path, part_size)
        return _BlockWriter(self, path, part_size)

    def _discard_write(self, handle: IO[bytes]) -> None:
        if isinstance(handle, _BlockWriter):  # nothing is visible before the commit
            handle.discard()
            return
        super()._discard_write(handle)

    def _remove_files(self, paths: list[str]) -> None:
        by_container: dict[str, list[str]] = {}
        for path in paths:
            container, key = self._split(path)
            by_container.setdefault(container, []).append(key)
        for container, keys in by_container.items():
            for start in range(0, len(keys), DELETE_BATCH):
                batch = keys[start : start + DELETE_BATCH]
                self._call(container, functools.partial(_delete_batch, keys=batch))
        for path in paths:
            self.fs.invalidate_cache(path)


def new_block_id() -> str:
    """A block id: base64 of 32 characters, the same length for every block of a blob."""
    return base64.b64encode(uuid.uuid4().hex.encode()).decode()


class _BlockWriter:
    """A streamed upload to Azure: ``buffer`` holds at most one part (``storage.recording``
    tops it up to exactly one), each full part is staged as a block at once, ``close``
    commits the blocks (or puts a file of less than one part in one request)."""

    def __init__(self, backend: AzureBackend, path: str, part_size: int) -> None:
        self.backend = backend
        self.path = path
        self.part_size = part_size
        self.buffer = io.BytesIO()
        self.blocks: list[str] = []
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        start = 0
        while start < view.nbytes:
            room = self.part_size - self.buffer.tell()
            self.buffer.write(view[start : start + room])
            start += room
            if self.buffer.tell() >= self.part_size:
                self._stage()
        return view.nbytes

    def flush(self) -> None:
        """Parts go out as they fill: nothing to do before ``close``."""

    def _stage(self) -> None:
        block = new_block_id()
        self.backend.stage_block(self.path, block, self.buffer.getvalue())
        self.blocks.append(block)
        self.buffer = io.BytesIO()

    def close(self) -> None:
        if self.closed:
            return
        if not self.blocks:
            self.backend.retry.call(self.backend.fs.pipe_file, self.path, self.buffer.getvalue())
        else:
            if self.buffer.tell():
                self._stage()
            self.backend.commit_blocks(self.path, self.blocks)
        self.closed = True

    def discard(self) -> None:
        """Drop the file: its staged blocks were never committed, so nothing is visible."""
        self.buffer = io.BytesIO()
        self.closed = True


async def _delete_batch(client: Any, *, keys: list[str]) -> None:
    """Delete ``keys``, one ``Delete Blob`` each, all sent at once (a blob already gone is no
    failure). Not a ``Blob Batch``: Azurite answers the SDK's asynchronous batch request
    with one 400 ``InvalidInput`` (its synchronous one works), so the batch API could not be
    tested here."""
    done = await asyncio.gather(*(client.delete_blob(key) for key in keys), return_exceptions=True)
    for outcome in done:
        if isinstance(outcome, BaseException) and getattr(outcome, "status_code", None) != 404:
            raise outcome
