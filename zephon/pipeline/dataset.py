"""``Dataset``: a named, ordered set of shards, from memory or from files at any fsspec URL.

Shard ids are strings (file paths, names) or ints (shard numbers). One dataset uses one kind,
so their order is always well defined: strings sort as strings, ints as numbers (2 before 10).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from typing import Any

from zephon.errors import ConfigError
from zephon.pipeline.errors import DataSourceError
from zephon.pipeline.shards import JsonlShard, ParquetShard, Shard, _RowCache

__all__ = ["Dataset", "ShardId"]

ShardId = int | str

_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class Dataset:
    """A named collection of shards, each a sequence of records read by range.

    Shards are kept in sorted shard-id order, so the same files always make the same dataset,
    whatever order a directory listing returns them in. Shard ids are all non-empty strings or
    all ints (``numpy`` integers become ``int``); a mix is refused, since it has no natural
    order and would make ``0`` and ``"0"`` look alike in sample ids.
    """

    def __init__(self, name: str, shards: Mapping[ShardId, Shard]) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(
                f"Dataset name must be 1-128 characters of [A-Za-z0-9._-], got {name!r}"
            )
        if not isinstance(shards, Mapping):
            raise ConfigError(
                f"Dataset {name!r}: shards must be a {{shard_id: shard}} mapping, got "
                f"{type(shards).__name__}"
            )
        if not shards:
            raise ConfigError(f"Dataset {name!r} needs at least one shard, got none")
        checked: dict[ShardId, Shard] = {}
        for shard_id, shard in shards.items():
            key = _shard_key(name, shard_id)
            if not isinstance(shard, Shard):
                raise ConfigError(
                    f"Dataset {name!r}: shard {shard_id!r} must be a shard (e.g. "
                    f"zephon.InMemoryShard(rows)), got {type(shard).__name__}"
                )
            checked[key] = shard
        kinds = {type(k) for k in checked}
        if len(kinds) > 1:
            first_int = next(k for k in checked if isinstance(k, int))
            first_str = next(k for k in checked if isinstance(k, str))
            raise ConfigError(
                f"Dataset {name!r}: shard ids must be all ints or all strings, got both "
                f"({first_int!r} and {first_str!r}); use one kind, e.g. str(i) for every int"
            )
        self.name = name
        self.shards: dict[ShardId, Shard] = {k: checked[k] for k in sorted(checked)}

    @classmethod
    def from_dict(cls, name: str, shards: Mapping[ShardId, Shard]) -> Dataset:
        """A dataset from ``{shard_id: shard}``, e.g. ``{"a": zephon.InMemoryShard(rows)}`` or
        ``{0: zephon.InMemoryShard(rows)}``."""
        return cls(name, shards)

    @classmethod
    def from_path(
        cls,
        name: str,
        url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        format: str | None = None,
        path: str | None = None,
        fmt: str | None = None,
    ) -> Dataset:
        """A dataset from one file or a directory of JSONL / Parquet files at any fsspec URL.

        ``url`` is a plain path, ``file://``, ``s3://bucket/prefix``, ``gs://...``, or a glob
        such as ``s3://bucket/data/*.parquet``; backend settings (endpoint, credentials
        profile) go in ``storage_options``. A directory is
        searched recursively for ``.jsonl``/``.ndjson``/``.json`` and ``.parquet``/``.pq``
        files; each file is a shard whose id is its path relative to ``url``. ``format``
        (``"jsonl"`` or ``"parquet"``) forces one reader for every file regardless of suffix.

        ``path=`` and ``fmt=`` are the same as ``url=`` and ``format=`` (the names the Zephon
        data library uses), so ``from_path(name="web", path="s3://b/web", fmt="jsonl")`` works
        too; give each value once.
        """
        from zephon.storage import open_location

        url = _one_of(name, "url", url, "path", path, required=True)
        format = _one_of(name, "format", format, "fmt", fmt)
        if not isinstance(url, str) or not url:
            raise ConfigError(
                f"Dataset.from_path({name!r}): url (or path) must be a non-empty string, "
                f"got {url!r}"
            )
        if format is not None and format not in {"jsonl", "parquet"}:
            raise ConfigError(f"format (or fmt) must be 'jsonl', 'parquet' or None, got {format!r}")
        location = open_location(url, storage_options)
        fs, root = location.fs, location.root
        try:
            if any(c in root for c in "*?["):
                paths = sorted(p for p in fs.glob(root) if not fs.isdir(p))
                base = root[: min(root.index(c) for c in "*?[" if c in root)].rsplit("/", 1)[0]
                entries = [
                    (p[len(base) + 1 :] if p.startswith(base + "/") else p, p) for p in paths
                ]
            elif fs.isdir(root):
                paths = sorted(p for p in fs.find(root) if format or _format_of(p))
                base = root.rstrip("/") + "/"
                entries = [(p[len(base) :] if p.startswith(base) else p, p) for p in paths]
            elif fs.exists(root):
                entries = [(root.rsplit("/", 1)[-1], root)]
            else:
                raise DataSourceError(
                    f"dataset {name!r}: nothing at {location.url}; check the URL and "
                    "storage_options",
                    url=location.url,
                )
        except DataSourceError:
            raise
        except (OSError, ValueError) as exc:
            raise DataSourceError(
                f"dataset {name!r}: cannot list {location.url}: {exc}; check the URL and "
                "storage_options",
                url=location.url,
            ) from exc
        if not entries:
            raise DataSourceError(
                f"dataset {name!r}: no .jsonl or .parquet files under {location.url}; pass "
                "format='jsonl' or 'parquet' if the files have other suffixes",
                url=location.url,
            )
        cache = _RowCache()
        shards: dict[ShardId, Shard] = {}
        for shard_id, file_path in entries:
            kind = format or _format_of(file_path)
            if kind is None:
                raise DataSourceError(
                    f"dataset {name!r}: cannot tell the format of "
                    f"{location.display(file_path)}; pass format='jsonl' or format='parquet'",
                    url=location.display(file_path),
                )
            shard_cls = ParquetShard if kind == "parquet" else JsonlShard
            shards[shard_id] = shard_cls(
                fs, file_path, location.display(file_path), cache, location.retry
            )
        return cls(name, shards)

    def __len__(self) -> int:
        """The number of records over all shards (reads JSONL files once to count lines)."""
        return sum(len(s) for s in self.shards.values())

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, {len(self.shards)} shards)"


def _shard_key(name: str, shard_id: Any) -> ShardId:
    """``shard_id`` as stored: a non-empty string, or an ``int`` (any integral but ``bool``)."""
    if isinstance(shard_id, str) and shard_id:
        return shard_id
    if isinstance(shard_id, numbers.Integral) and not isinstance(shard_id, bool):
        return int(shard_id)
    raise ConfigError(
        f"Dataset {name!r}: shard ids must be non-empty strings or ints, got {shard_id!r}"
    )


def _one_of(name: str, first: str, a: Any, second: str, b: Any, *, required: bool = False) -> Any:
    """The value of a parameter that has two spellings (``url``/``path``, ``format``/``fmt``)."""
    if a is not None and b is not None:
        raise ConfigError(
            f"Dataset.from_path({name!r}): give {first}= or {second}=, not both "
            f"(got {a!r} and {b!r})"
        )
    value = a if a is not None else b
    if value is None and required:
        raise ConfigError(
            f"Dataset.from_path({name!r}) needs the data's location: pass {first}= (or "
            f"{second}=), e.g. Dataset.from_path({name!r}, 's3://bucket/prefix')"
        )
    return value


def _format_of(path: str) -> str | None:
    lower = path.lower()
    for suffix, kind in _FORMATS.items():
        if lower.endswith(suffix):
            return kind
    return None
