"""Small builders shared by the pipeline tests."""

from __future__ import annotations

import zephon
from zephon.pipeline import Pipeline


def make_dataset(name: str = "ds", shards: int = 5, per_shard: int = 37) -> zephon.Dataset:
    return zephon.Dataset.from_dict(
        name,
        {
            f"s{i:03d}": zephon.InMemoryShard(
                [{"id": f"{name}-{i}-{j}", "n": i * 1000 + j} for j in range(per_shard)]
            )
            for i in range(shards)
        },
    )


def keys_of(batches) -> list[tuple[int, int, int]]:
    return [k for b in batches for k in b.keys]


def ids_of(batches) -> list[str]:
    return [p["id"] for b in batches for p in b.payloads]


def drop_every_7th(record: dict) -> dict | None:
    return None if record["n"] % 7 == 3 else record


def simple_pipeline(
    dataset=None,
    *,
    chunk_size=10,
    lanes=2,
    batch=4,
    drop_last=False,
    shuffle=None,
    flush=None,
    **options,
) -> Pipeline:
    source = zephon.StaticMixtureWorkSource(
        dataset or make_dataset(), chunk_size=chunk_size, seed=3
    )
    p = zephon.Pipeline(source)
    if shuffle:
        p.shuffle(shuffle, seed=5)
    p.batch(batch, drop_last=drop_last)
    return p.options(canonical_replicas=lanes, flush_every_k_chunks=flush, **options)
