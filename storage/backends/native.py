"""The native data path: checkpoint payload bytes to and from S3 and Azure (and, when asked
for, GCS) through obstore (Rust's ``object_store``) instead of s3fs / adlfs / gcsfs.

Only the payload goes this way: whole-file and streamed uploads (``put_bytes``,
``put_buffer``, ``open_write``) and reads (``read_file``, ``read_range``,
``read_range_into``, ``get_file``). Markers (the create-only PUT), listings, existence checks,
copies and deletes stay on the fsspec filesystem, so the commit protocol and the fence are
exactly those of the fsspec path.

The client is built from the storage_options the user gave the fsspec filesystem
(``native_client`` maps them, ``fs.storage_options``), so nothing changes for the user; an
option or a store it cannot map keeps the backend on fsspec, and the reason is logged at
debug level (``logging.getLogger("zephon.storage.native")``). ``storage_options={"native":
False}`` or ``ZEPHON_NATIVE=0`` turns it off; ``{"native": True}`` turns it on where it is off
by default (GCS, see ``DEFAULT_ON``).

Retries: one policy, Zephon's (``storage.retry``). Reads and single PUTs go through a client
that never retries (``max_retries=0``) and are tried again by the backend's policy, like every
other primitive. A multipart upload's parts can only be tried again inside obstore (it sends
them itself), so uploads go through a second client whose retry settings are the policy's own
(attempts, deadline, backoff), and a failure it gave up on is not tried again around it: a
failed part is sent again alone, never the whole file, and the tries never multiply.

One client per (protocol, bucket, options, retry policy) per process (``_CLIENTS``), shared by
every location opened with them: one connection pool. fsspec already keeps one filesystem per
(class, options) per process for s3fs, gcsfs and adlfs (they are asynchronous).
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any, TypeVar
from urllib.parse import urlparse

from zephon.storage.backends.translate import native_errors
from zephon.storage.retry import RetryPolicy

__all__ = [
    "DEFAULT_ON",
    "ENVIRONMENT",
    "OPTION",
    "NativeClient",
    "NativeWriter",
    "native_client",
    "native_wanted",
]

log = logging.getLogger("zephon.storage.native")

T = TypeVar("T")

#: the storage option that turns the native data path on (True) or off (False)
OPTION = "native"
#: the environment variable that turns it off for every location ("0", "false", "off", "no")
ENVIRONMENT = "ZEPHON_NATIVE"
#: protocols whose native path is on unless turned off; the others only with ``native=True``.
#: GCS is off by default: obstore's GCS client speaks GCS's XML API (PUT and GET of
#: ``/<bucket>/<key>``, multipart as ``POST ?uploads``, ``PUT ?partNumber&uploadId``,
#: ``POST ?uploadId``) and requires an ETag on every PUT reply and an ETag and Last-Modified on
#: every GET reply. No GCS emulator CI can install serves that (docs/storage.md, "The native
#: data path", lists what each lacks), so the GCS native path is untested here.
DEFAULT_ON = frozenset({"s3", "s3a", "az", "abfs", "abfss"})
#: storage options that only shape the fsspec filesystem's own behaviour (caches, its block
#: sizes, its event loop): the native client has nothing to map them to and needs nothing
_FSSPEC_ONLY = frozenset(
    {
        OPTION,
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "cache_regions",
        "asynchronous",
        "loop",
        "max_concurrency",
        "fixed_upload_size",
        "project",
        "blocksize",
        "version_aware",
    }
)
_OFF_WORDS = frozenset({"0", "false", "off", "no"})
#: the S3 connection pool Zephon asks s3fs for (``object_store.DEFAULT_POOL_CONNECTIONS``),
#: which the native client's concurrency matches; a pool size the user set keeps fsspec.
#: 32 uploads at once (``object_store.UPLOAD_WORKERS``) and 8 for the requests a commit sends
#: beside a full wave of them (its fence re-check and payload listing)
POOL_CONNECTIONS = 40
#: the smallest chunk a streamed ranged GET hands over (``range_chunks``): what a reading
#: thread holds at a time, however long the range
STREAM_CHUNK = 1 << 20


class Unmappable(Exception):
    """An option or a store the native client cannot take as the fsspec filesystem does."""


def native_wanted(protocol: str, options: Mapping[str, Any]) -> str | None:
    """None if the native path should be tried for ``protocol`` with ``options``; else the
    reason it is not."""
    if os.environ.get(ENVIRONMENT, "").strip().lower() in _OFF_WORDS:
        return f"{ENVIRONMENT}={os.environ[ENVIRONMENT]}"
    if _FORKED_AFTER_USE:
        return (
            "this process was forked after its parent used obstore, whose runtime does not "
            "survive a fork"
        )
    choice = options.get(OPTION)
    if choice is False:
        return f"storage_options {OPTION}=False"
    if choice is not True and protocol not in DEFAULT_ON:
        return f"{protocol}:// is on fsspec unless storage_options {OPTION}=True"
    try:
        import obstore  # noqa: F401
    except ImportError:
        return "obstore is not installed (pip install obstore)"
    return None


def native_client(
    protocol: str, options: Mapping[str, Any], bucket: str, policy: RetryPolicy
) -> NativeClient | None:
    """The process's native client for ``bucket`` of ``protocol`` with the fsspec storage
    ``options``, or None (with the reason logged at debug level) where the fsspec path stays:
    this is the one place that decides."""
    reason = native_wanted(protocol, options)
    if reason is None:
        try:
            key, build = _builder(protocol, dict(options), bucket)
        except Unmappable as exc:
            reason = str(exc)
    if reason is not None:
        log.debug("%s://%s: payload bytes go through fsspec: %s", protocol, bucket, reason)
        return None
    cache_key = (protocol, bucket, key, policy)
    with _LOCK:
        client = _CLIENTS.get(cache_key)
        if client is None:
            client = NativeClient(
                protocol, bucket, build({"max_retries": 0}), build(_retry_config(policy))
            )
            _CLIENTS[cache_key] = client
    log.debug("%s://%s: payload bytes go through obstore", protocol, bucket)
    return client


_CLIENTS: dict[tuple[Any, ...], NativeClient] = {}
_LOCK = threading.Lock()
#: whether this process is a child forked after its parent made a client: obstore's runtime
#: (its threads) does not survive a fork, and a new client in the child hangs on its first
#: request (seen with obstore 0.12.1), so a forked child keeps the fsspec path
_FORKED_AFTER_USE = False


def _after_fork_in_child() -> None:
    global _FORKED_AFTER_USE, _LOCK
    _FORKED_AFTER_USE = _FORKED_AFTER_USE or bool(_CLIENTS)
    _CLIENTS.clear()
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _retry_config(policy: RetryPolicy) -> dict[str, Any]:
    """obstore's retry settings with the values of Zephon's policy (for multipart uploads)."""
    return {
        "max_retries": policy.max_attempts - 1,
        "retry_timeout": dt.timedelta(seconds=policy.deadline_s),
        "backoff": {
            "init_backoff": dt.timedelta(seconds=max(policy.base_backoff_s, 0.001)),
            "max_backoff": dt.timedelta(seconds=max(policy.max_backoff_s, 0.001)),
            "base": 2,
        },
    }


class NativeClient:
    """obstore stores of one bucket: ``once`` never retries (each call is tried again by the
    backend's policy), ``parts`` retries each request itself under the policy (uploads)."""

    def __init__(self, protocol: str, bucket: str, once: Any, parts: Any) -> None:
        self.protocol = protocol
        self.bucket = bucket
        self.once = once
        self.parts = parts
        #: the process that made it: a forked child makes its own
        self.pid = os.getpid()
        #: requests sent, by kind: tests check that the native path is taken
        self.calls: dict[str, int] = {}
        #: called with (key, start, end) before every ranged GET: what tests observe (as they
        #: hook botocore's events on the fsspec path)
        self.observers: list[Callable[[str, int, int], None]] = []

    def __repr__(self) -> str:  # never the stores: their configuration holds credentials
        return f"NativeClient({self.protocol!r}, {self.bucket!r})"

    def key(self, path: str) -> str:
        """The object key of a fsspec path ``bucket/key``."""
        bucket, _, key = path.lstrip("/").partition("/")
        if bucket != self.bucket:
            raise Unmappable(f"{path} is not in bucket {self.bucket}")
        return key

    def _count(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def _run(self, kind: str, call: Callable[[], T], *, given_up: bool = False) -> T:
        self._count(kind)
        with native_errors(given_up=given_up):
            return call()

    # -- reads: one request each, tried again by the backend's policy ------------------------

    def read_file(self, path: str) -> bytes:
        """The whole object."""
        import obstore

        key = self.key(path)
        return self._run("get", lambda: obstore.get(self.once, key).bytes().to_bytes())

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` (fewer at the end of the object)."""
        return self._range(path, start, end).to_bytes() if end > start else b""

    def _range(self, path: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` as obstore's buffer (Rust-owned memory, no bytes object)."""
        import obstore

        key = self.key(path)
        for observe in self.observers:
            observe(key, start, end)
        return self._run(
            "get_range", lambda: obstore.get_range(self.once, key, start=start, end=end)
        )

    def read_range_into(self, path: str, start: int, buffer: memoryview) -> int:
        """Bytes from ``start`` into ``buffer`` (as many as it holds, fewer at the end of the
        object); returns how many. obstore owns the reply's buffer: one copy into ``buffer``."""
        if not buffer.nbytes:
            return 0
        data = self._range(path, start, start + buffer.nbytes)
        count = memoryview(data).nbytes
        buffer[:count] = data
        return count

    def range_chunks(self, path: str, start: int, end: int) -> Iterator[memoryview]:
        """Bytes ``[start, end)`` (fewer at the end of the object) from one ranged GET, as the
        chunks of its reply (obstore's buffers of at least ``STREAM_CHUNK`` bytes but the last;
        no bytes object): a store that reads a whole object per request reads it once, and
        the caller holds one chunk at a time however long the range."""
        import obstore

        if end <= start:
            return
        key = self.key(path)
        for observe in self.observers:
            observe(key, start, end)
        reply = self._run(
            "get_range", lambda: obstore.get(self.once, key, options={"range": (start, end)})
        )
        chunks = reply.stream(min_chunk_size=STREAM_CHUNK)
        while True:
            with native_errors():
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield memoryview(chunk)

    def get_file(self, path: str, local_path: str) -> None:
        """Download the object to ``local_path`` in the reply's chunks."""
        import obstore

        key = self.key(path)

        def download() -> None:
            result = obstore.get(self.once, key)
            with open(local_path, "wb") as out:
                for chunk in result.stream(min_chunk_size=8 << 20):
                    out.write(chunk)

        self._run("get", download)

    # -- writes ---------------------------------------------------------------------------------

    def put(self, path: str, data: Any, part_size: int, concurrency: int) -> None:
        """Write one whole object from any C-contiguous buffer, read in place (no copy): one
        PUT below two parts (tried again by the backend's policy), else a multipart upload of
        ``part_size`` parts sent ``concurrency`` at a time, each tried again alone."""
        import obstore

        view = memoryview(data)
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        key = self.key(path)
        if view.nbytes < 2 * part_size:
            self._run("put", lambda: obstore.put(self.once, key, view, use_multipart=False))
            return

        def upload() -> None:
            obstore.put(
                self.parts,
                key,
                view,
                use_multipart=True,
                chunk_size=part_size,
                max_concurrency=concurrency,
            )

        self._run("put_multipart", upload, given_up=True)

    def open_write(self, path: str, part_size: int, concurrency: int) -> IO[bytes]:
        """A file streamed into the object: one PUT on close for a file below two parts, else a
        multipart upload of ``part_size`` parts sent ``concurrency`` at a time (each tried
        again alone) that starts once two parts are written (``NativeWriter``)."""
        self._count("open_write")
        return NativeWriter(self, self.key(path), part_size, concurrency)  # type: ignore[return-value]


class _Stop(Exception):
    """Raised into obstore's upload by ``NativeWriter.discard``: it aborts the upload."""


class NativeWriter:
    """A file streamed into one object through obstore, without copying what it is given
    in place.

    Written buffers are queued as they are, a list of views, never joined: obstore cuts them
    into parts and sends each part as the list of pieces it spans, so bytes written with
    ``write_in_place`` (a tensor's memory during a save) go from their own memory into the
    request. ``write`` copies its data once (the caller may reuse its buffer when it returns),
    as a buffered file would.

    Below two parts nothing is sent until ``close``, which sends one PUT (a file smaller than
    a part cannot be a multipart upload). Past two parts the multipart upload starts on a
    thread of its own, pulling the queued pieces; the writer waits while more than two parts
    are queued but not yet taken, so a file holds at most about ``concurrency + 2`` parts of
    memory beyond what lies in place (the parts in flight, held by obstore, and the queue).
    An upload error reaches the next ``write`` or ``close``; ``discard`` aborts the upload,
    which publishes nothing.
    """

    def __init__(self, client: NativeClient, key: str, part_size: int, concurrency: int) -> None:
        self._client = client
        self._key = key
        self._part_size = max(part_size, 1)
        self._concurrency = concurrency
        self._queue: collections.deque[memoryview] = collections.deque()
        self._queued = 0  # bytes queued, not yet taken by the upload
        self._done = False  # no more writes: the upload ends after the queue
        self._stop = False  # discard: the upload aborts
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Condition()
        self.closed = False

    def write(self, data: Any) -> int:
        """Queue a copy of ``data``; returns its length."""
        return self.write_in_place(memoryview(bytes(memoryview(data).cast("B"))))

    def write_in_place(self, data: Any) -> int:
        """Queue ``data`` itself, never copied: the caller keeps it alive and unchanged until
        the file is closed or discarded. Returns its length."""
        view = memoryview(data)
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        size = view.nbytes
        if not size:
            return 0
        limit = 2 * self._part_size
        with self._ready:
            while self._thread is not None and self._queued >= limit and self._error is None:
                self._ready.wait()
            self._raise_error()
            self._queue.append(view)
            self._queued += size
            self._ready.notify_all()
            start = self._thread is None and self._queued >= limit
        if start:
            self._client._count("stream_multipart")
            self._thread = threading.Thread(
                target=self._upload, name="zephon-native-upload", daemon=True
            )
            self._thread.start()
        return size

    def flush(self) -> None:
        """Parts go out as they fill: nothing to do before ``close``."""

    def close(self) -> None:
        """Send what is left and complete the object; it is visible when this returns."""
        if self.closed:
            return
        if self._thread is None:
            import obstore

            pieces, self._queue = list(self._queue), collections.deque()
            self._client._run(
                "put",
                lambda: obstore.put(self._client.parts, self._key, pieces, use_multipart=False),
                given_up=True,
            )
        else:
            with self._ready:
                self._done = True
                self._ready.notify_all()
            self._thread.join()
            with self._ready:
                self._raise_error()
        self.closed = True

    def discard(self) -> None:
        """Abandon the file: an upload under way is aborted, nothing is published."""
        with self._ready:
            self._stop = True
            self._queue.clear()
            self._queued = 0
            self._ready.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.closed = True

    # -- the upload thread ---------------------------------------------------------------------

    def _raise_error(self) -> None:
        if self._error is not None:
            with native_errors(given_up=True):
                raise self._error

    def _pieces(self) -> Iterator[memoryview]:
        """The queued pieces, in order, as obstore asks for them (on the upload thread)."""
        while True:
            with self._ready:
                while not self._queue and not self._done and not self._stop:
                    self._ready.wait()
                if self._stop:
                    raise _Stop
                if not self._queue:
                    return
                piece = self._queue.popleft()
                self._queued -= piece.nbytes
                self._ready.notify_all()
            yield piece

    def _upload(self) -> None:
        import obstore

        try:
            obstore.put(
                self._client.parts,
                self._key,
                self._pieces(),
                use_multipart=True,
                chunk_size=self._part_size,
                max_concurrency=self._concurrency,
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the writing thread
            with self._ready:
                self._error = None if self._stop else exc
                self._ready.notify_all()


# -- mapping storage_options --------------------------------------------------------------------


def _builder(
    protocol: str, options: dict[str, Any], bucket: str
) -> tuple[str, Callable[[dict[str, Any]], Any]]:
    """``(key, build)``: a text that identifies the mapped configuration (the client cache's
    key) and ``build(retry_config)``, which makes an obstore store of it. ``Unmappable`` for
    what cannot be mapped."""
    if protocol in ("s3", "s3a"):
        config, client = _s3_config(options)
        store = "S3Store"
    elif protocol in ("az", "abfs", "abfss"):
        config, client = _azure_config(options)
        store = "AzureStore"
    elif protocol in ("gs", "gcs"):
        config, client = _gcs_config(options)
        store = "GCSStore"
    else:
        raise Unmappable(f"obstore has no client for {protocol}://")
    key = json.dumps([store, config, client], sort_keys=True, default=str)

    def build(retry_config: dict[str, Any]) -> Any:
        from obstore import store as stores

        cls = getattr(stores, store)
        with native_errors():
            return cls(bucket, config=config, client_options=client, retry_config=retry_config)

    return key, build


def _refuse_unknown(options: Mapping[str, Any], known: set[str], where: str = "") -> None:
    for name in options:
        if name not in known and name not in _FSSPEC_ONLY:
            raise Unmappable(f"storage_options {where}{name} has no native equivalent")


def _client_options(endpoint: str | None, config_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    client: dict[str, Any] = {}
    if endpoint and endpoint.startswith("http://"):
        client["allow_http"] = True
    for ours, theirs in (("connect_timeout", "connect_timeout"), ("read_timeout", "timeout")):
        if config_kwargs.get(ours) is not None:
            client[theirs] = dt.timedelta(seconds=float(config_kwargs[ours]))
    return client


#: botocore Config keys the S3 mapping handles (or, for ``retries`` and the checksum
#: settings, that Zephon sets for botocore alone)
_BOTOCORE_KEYS = {
    "max_pool_connections",
    "retries",
    "connect_timeout",
    "read_timeout",
    "request_checksum_calculation",
    "response_checksum_validation",
    "s3",
    "signature_version",
    "region_name",
}


def _s3_config(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    _refuse_unknown(
        options,
        {
            "key",
            "secret",
            "token",
            "anon",
            "endpoint_url",
            "client_kwargs",
            "config_kwargs",
            "use_ssl",
            "requester_pays",
            "s3_additional_kwargs",
        },
    )
    client_kwargs = dict(options.get("client_kwargs") or {})
    if "config" in client_kwargs:
        raise Unmappable("a botocore Config object in client_kwargs cannot be read")
    _refuse_unknown(
        client_kwargs,
        {
            "endpoint_url",
            "region_name",
            "aws_access_key_id",
            "aws_secret_access_key",
            "aws_session_token",
        },
        "client_kwargs.",
    )
    config_kwargs = dict(options.get("config_kwargs") or {})
    _refuse_unknown(config_kwargs, _BOTOCORE_KEYS, "config_kwargs.")
    pool = config_kwargs.get("max_pool_connections")
    if pool is not None and pool != POOL_CONNECTIONS:
        raise Unmappable(
            f"config_kwargs.max_pool_connections={pool}: obstore cannot bound its connections"
        )
    extra = dict(options.get("s3_additional_kwargs") or {})
    _refuse_unknown(extra, {"ServerSideEncryption", "SSEKMSKeyId"}, "s3_additional_kwargs.")

    config: dict[str, Any] = {"unsigned_payload": True}
    endpoint = (
        options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        config["endpoint"] = endpoint
    region = (
        client_kwargs.get("region_name")
        or config_kwargs.get("region_name")
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
    )
    if not region and not endpoint:
        raise Unmappable(
            "the bucket's region is not given (s3fs asks S3 for it): set "
            "client_kwargs.region_name or AWS_REGION"
        )
    config["region"] = region or "us-east-1"
    if options.get("anon") or config_kwargs.get("signature_version") in ("unsigned", "UNSIGNED"):
        config["skip_signature"] = True
    else:
        key = options.get("key") or client_kwargs.get("aws_access_key_id")
        secret = options.get("secret") or client_kwargs.get("aws_secret_access_key")
        token = options.get("token") or client_kwargs.get("aws_session_token")
        if not key and not secret:
            key = os.environ.get("AWS_ACCESS_KEY_ID")
            secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
            token = token or os.environ.get("AWS_SESSION_TOKEN")
        if not key or not secret:
            raise Unmappable(
                "credentials come from botocore's own chain (profiles, instance metadata), "
                "not from storage_options or the AWS_* environment"
            )
        config["access_key_id"] = key
        config["secret_access_key"] = secret
        if token:
            config["session_token"] = token
    if config_kwargs.get("signature_version") not in (None, "s3v4", "unsigned", "UNSIGNED"):
        raise Unmappable(f"signature_version {config_kwargs['signature_version']!r}")
    style = (config_kwargs.get("s3") or {}).get("addressing_style")
    if style == "virtual":
        config["virtual_hosted_style_request"] = True
    if options.get("requester_pays"):
        config["request_payer"] = True
    if "ServerSideEncryption" in extra:
        config["server_side_encryption"] = extra["ServerSideEncryption"]
    if "SSEKMSKeyId" in extra:
        config["sse_kms_key_id"] = extra["SSEKMSKeyId"]
    client = _client_options(endpoint, config_kwargs)
    if options.get("use_ssl") is False and endpoint and endpoint.startswith("http://"):
        client["allow_http"] = True
    return config, client


def _connection_string(text: str) -> dict[str, str]:
    parts = {}
    for item in text.split(";"):
        name, sep, value = item.partition("=")
        if sep:
            parts[name.strip()] = value.strip()
    return parts


def _azure_config(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    _refuse_unknown(
        options,
        {
            "connection_string",
            "account_name",
            "account_key",
            "sas_token",
            "client_id",
            "client_secret",
            "tenant_id",
            "anon",
            "account_host",
        },
    )
    environ = os.environ
    connection = options.get("connection_string") or (
        None if options.get("account_name") else environ.get("AZURE_STORAGE_CONNECTION_STRING")
    )
    config: dict[str, Any] = {}
    endpoint: str | None = None
    if connection:
        parts = _connection_string(connection)
        if parts.get("UseDevelopmentStorage", "").lower() == "true":
            config["use_emulator"] = True
        if "AccountName" in parts:
            config["account_name"] = parts["AccountName"]
        if "AccountKey" in parts:
            config["account_key"] = parts["AccountKey"]
        if "SharedAccessSignature" in parts:
            config["sas_key"] = parts["SharedAccessSignature"]
        endpoint = parts.get("BlobEndpoint")
        if not endpoint and "AccountName" in parts and "EndpointSuffix" in parts:
            scheme = parts.get("DefaultEndpointsProtocol", "https")
            endpoint = f"{scheme}://{parts['AccountName']}.blob.{parts['EndpointSuffix']}"
    else:
        name = options.get("account_name") or environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        if not name:
            raise Unmappable("no account_name or connection_string")
        config["account_name"] = name
        key = options.get("account_key") or environ.get("AZURE_STORAGE_ACCOUNT_KEY")
        sas = options.get("sas_token") or environ.get("AZURE_STORAGE_SAS_TOKEN")
        client_id = options.get("client_id") or environ.get("AZURE_STORAGE_CLIENT_ID")
        if key:
            config["account_key"] = key
        elif sas:
            config["sas_key"] = sas.lstrip("?")
        elif client_id:
            config["client_id"] = client_id
            config["client_secret"] = options.get("client_secret") or environ.get(
                "AZURE_STORAGE_CLIENT_SECRET", ""
            )
            config["tenant_id"] = options.get("tenant_id") or environ.get(
                "AZURE_STORAGE_TENANT_ID", ""
            )
        elif options.get("anon"):
            config["skip_signature"] = True
        else:
            raise Unmappable(
                "credentials come from the Azure SDK's default chain, which the native "
                "client does not read the same way"
            )
        if options.get("account_host"):
            endpoint = f"https://{options['account_host']}"
    if endpoint:
        config["endpoint"] = endpoint.rstrip("/")
    return config, _client_options(endpoint, {})


def _gcs_config(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    _refuse_unknown(options, {"token", "endpoint_url"})
    config: dict[str, Any] = {}
    endpoint = options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST")
    if endpoint:
        config["base_url"] = endpoint
    token = options.get("token")
    if token == "anon":
        # obstore 0.12's GCS client skips signing its reads only: an upload still asks the
        # metadata server for a token, which fails off Google Cloud
        raise Unmappable("token='anon': obstore's GCS client fetches a token for uploads anyway")
    if isinstance(token, dict):
        config["service_account_key"] = json.dumps(token)
    elif isinstance(token, str) and os.path.isfile(token):
        config["service_account"] = token
    elif token not in (None, "google_default"):
        raise Unmappable(f"token of type {type(token).__name__}")
    host = urlparse(endpoint).scheme if endpoint else ""
    return config, {"allow_http": True} if host == "http" else {}
