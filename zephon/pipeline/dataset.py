"""``Dataset``: a named, ordered set of shards, from memory or from files at any fsspec URL."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from zephon.errors import ConfigError
from zephon.pipeline.errors import DataSourceError
from zephon.pipeline.shards import JsonlShard, ParquetShard, Shard, _RowCache

__all__ = ["Dataset"]

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
    whatever order a directory listing returns them in.
    """

    def __init__(self, name: str, shards: Mapping[str, Shard]) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(
                f"Dataset name must be 1-128 characters of [A-Za-z0-9._-], got {name!r}"
            )
        if not shards:
            raise ConfigError(f"Dataset {name!r} needs at least one shard, got none")
        for shard_id, shard in shards.items():
            if not isinstance(shard_id, str) or not shard_id:
                raise ConfigError(
                    f"Dataset {name!r}: shard ids must be non-empty strings, got {shard_id!r}"
                )
            if not isinstance(shard, Shard):
                raise ConfigError(
                    f"Dataset {name!r}: shard {shard_id!r} must be a shard (e.g. "
                    f"zephon.InMemoryShard(rows)), got {type(shard).__name__}"
                )
        self.name = name
        self.shards: dict[str, Shard] = {k: shards[k] for k in sorted(shards)}

    @classmethod
    def from_dict(cls, name: str, shards: Mapping[str, Shard]) -> Dataset:
        """A dataset from ``{shard_id: shard}``, e.g. ``{"a": zephon.InMemoryShard(rows)}``."""
        return cls(name, shards)

    @classmethod
    def from_path(
        cls,
        name: str,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        format: str | None = None,
    ) -> Dataset:
        """A dataset from one file or a directory of JSONL / Parquet files at any fsspec URL.

        ``url`` is a plain path, ``file://``, ``s3://bucket/prefix``, ``gs://...``, or a glob
        such as ``s3://bucket/data/*.parquet``; backend settings (endpoint, credentials
        profile) go in ``storage_options``. A directory is
        searched recursively for ``.jsonl``/``.ndjson``/``.json`` and ``.parquet``/``.pq``
        files; each file is a shard whose id is its path relative to ``url``. ``format``
        (``"jsonl"`` or ``"parquet"``) forces one reader for every file regardless of suffix.
        """
        from storage.location import open_location

        if format is not None and format not in {"jsonl", "parquet"}:
            raise ConfigError(f"format must be 'jsonl', 'parquet' or None, got {format!r}")
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
        shards: dict[str, Shard] = {}
        for shard_id, path in entries:
            kind = format or _format_of(path)
            if kind is None:
                raise DataSourceError(
                    f"dataset {name!r}: cannot tell the format of {location.display(path)}; "
                    "pass format='jsonl' or format='parquet'",
                    url=location.display(path),
                )
            shard_cls = ParquetShard if kind == "parquet" else JsonlShard
            shards[shard_id] = shard_cls(fs, path, location.display(path), cache)
        return cls(name, shards)

    def __len__(self) -> int:
        """The number of records over all shards (reads JSONL files once to count lines)."""
        return sum(len(s) for s in self.shards.values())

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, {len(self.shards)} shards)"


def _format_of(path: str) -> str | None:
    lower = path.lower()
    for suffix, kind in _FORMATS.items():
        if lower.endswith(suffix):
            return kind
    return None
