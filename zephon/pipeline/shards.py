"""Shards: the unit a dataset is stored in, read by record range.

A shard only has to say how many records it holds and return a contiguous range of them; the
work source cuts shards into chunks by those numbers alone, so no data is read to plan a run.
File shards (JSONL, Parquet) are read through fsspec on first use and cached, a few at a time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from zephon.errors import ArgumentTypeError
from zephon.pipeline.errors import DataSourceError
from zephon.storage import DEFAULT_RETRY, RetryPolicy, parse_json

__all__ = ["InMemoryShard", "JsonlShard", "ParquetShard", "Shard"]


@runtime_checkable
class Shard(Protocol):
    """What the pipeline needs from a shard: its length, and rows ``[start, stop)`` in order."""

    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> list[Any]: ...


class InMemoryShard:
    """A shard held in memory: any sequence of records (dicts, strings, token lists...)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: Sequence[Any]) -> None:
        if isinstance(rows, (str, bytes)) or not hasattr(rows, "__len__"):
            raise ArgumentTypeError(
                "InMemoryShard needs a sequence of records (e.g. a list), got "
                f"{type(rows).__name__}"
            )
        self._rows = rows if isinstance(rows, list) else list(rows)

    def __len__(self) -> int:
        return len(self._rows)

    def read(self, start: int, stop: int) -> list[Any]:
        return self._rows[start:stop]

    def __repr__(self) -> str:
        return f"InMemoryShard({len(self._rows)} records)"


class _RowCache:
    """A small LRU of parsed file shards, so a lane reading a shard chunk by chunk parses it once.

    Shared by the file shards of one dataset; guarded by a lock because prefetch threads of
    several lanes may read at once.
    """

    def __init__(self, capacity: int = 4) -> None:
        self._capacity = capacity
        self._rows: OrderedDict[str, list[Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, load) -> list[Any]:
        with self._lock:
            rows = self._rows.get(key)
            if rows is not None:
                self._rows.move_to_end(key)
                return rows
        rows = load()
        with self._lock:
            self._rows[key] = rows
            self._rows.move_to_end(key)
            while len(self._rows) > self._capacity:
                self._rows.popitem(last=False)
        return rows


class _FileShard:
    """Common part of file shards: an fsspec filesystem, a path, and the shared row cache."""

    def __init__(
        self,
        fs,
        path: str,
        display: str,
        cache: _RowCache | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        self._fs = fs
        #: transient failures of a read are tried again (the location's policy)
        self._retry = retry
        self._path = path
        self._display = display
        self._cache = cache or _RowCache()
        self._length: int | None = None

    def _load(self) -> list[Any]:
        raise NotImplementedError

    def _with_file(self, read: Any) -> Any:
        """``read(handle)`` on the file, the whole of it tried again on transient failures."""

        def attempt() -> Any:
            with self._fs.open(self._path, "rb") as handle:
                return read(handle)

        return self._retry.call(attempt)

    def _rows(self) -> list[Any]:
        return self._cache.get(self._path, self._load)

    def __len__(self) -> int:
        if self._length is None:
            self._length = self._count()
        return self._length

    def _count(self) -> int:
        return len(self._rows())

    def read(self, start: int, stop: int) -> list[Any]:
        return self._rows()[start:stop]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._display!r})"


class JsonlShard(_FileShard):
    """One JSON object (or any JSON value) per line; blank lines are skipped."""

    def _load(self) -> list[Any]:
        try:
            data = self._with_file(lambda handle: handle.read())
        except (OSError, ValueError) as exc:
            raise DataSourceError(
                f"cannot read JSONL shard {self._display}: {exc}; check that it exists and is "
                "readable with the storage_options given",
                url=self._display,
            ) from exc
        rows = []
        for number, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(parse_json(line))
            except ValueError as exc:
                raise DataSourceError(
                    f"JSONL shard {self._display} line {number} is {exc}; fix or remove that line",
                    url=self._display,
                ) from exc
        return rows


class ParquetShard(_FileShard):
    """A Parquet file; each row becomes a dict of column -> Python value. Needs pyarrow."""

    @staticmethod
    def _pq():
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise DataSourceError(
                "reading Parquet shards needs pyarrow; install it with "
                "`pip install 'zephon[parquet]'` (or `pip install pyarrow`)"
            ) from exc
        return pq

    def _count(self) -> int:
        # The footer holds the row count: planning a run does not read the data pages.
        pq = self._pq()
        try:
            return self._with_file(lambda handle: pq.ParquetFile(handle).metadata.num_rows)
        except (OSError, ValueError) as exc:
            raise DataSourceError(
                f"cannot read Parquet shard {self._display}: {exc}; check that it is a Parquet "
                "file and readable with the storage_options given",
                url=self._display,
            ) from exc

    def _load(self) -> list[Any]:
        pq = self._pq()
        import pyarrow

        # The bytes are copied into memory pyarrow owns, and read with one synchronous reader.
        # pyarrow 26 may drop its last reference to the source on one of its own threads, even
        # after the read returned; when that source wraps a Python object (a file object or
        # bytes), the drop takes the GIL, and at interpreter exit that ends the process in
        # std::terminate ("terminate called without an active exception", seen in about one
        # run in twenty). Memory pyarrow owns is freed without Python.
        try:
            data = self._with_file(lambda handle: handle.read())
            owned = pyarrow.allocate_buffer(len(data))
            memoryview(owned).cast("B")[:] = data
            return pq.ParquetFile(pyarrow.BufferReader(owned)).read().to_pylist()
        except (OSError, ValueError) as exc:
            raise DataSourceError(
                f"cannot read Parquet shard {self._display}: {exc}; check that it is a Parquet "
                "file and readable with the storage_options given",
                url=self._display,
            ) from exc
