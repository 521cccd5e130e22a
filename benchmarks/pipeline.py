"""Benchmark of the data pipeline against same-run baselines (issues 5 and 11).

200,000 in-memory records (an int id and a 64-character string) in 20 shards, through
map + shuffle(1024) + batch(32) on 4 lanes. Prints, in one run:

- records/s against a torch DataLoader doing the same work (num_workers=0, identity collate);
- records/s of a CPU-heavy map (a pure-Python tokenizer stand-in over 24,000 records of about
  700 characters) with ``prefetch(8, parallelism=2)`` (worker processes) against the same
  pipeline with ``parallelism=1``;
- ``checkpoint()`` latency and state size after 1,000 batches;
- time from ``restore()`` to the first batch after 100, 1,000 and 4,000 batches, against a fresh
  pipeline's time to its first batch;
- records delivered in one full pass.

Run: ``python benchmarks/pipeline.py`` (needs torch for the baseline). The load average is
printed first and last: on a shared machine, compare runs made at a low one.
"""

from __future__ import annotations

import json
import os
import statistics
import string
import time

import zephon

# torch is imported where the baseline needs it, so that the map workers (which import this
# script to find ``tokenize``) do not import it too.

RECORDS = 200_000
SHARDS = 20
BATCH = 32
SHUFFLE = 1024
LANES = 4
CHUNK = 4096


def make_rows() -> dict[str, list[dict]]:
    alphabet = string.ascii_letters + string.digits
    per = RECORDS // SHARDS
    shards = {}
    for s in range(SHARDS):
        rows = []
        for j in range(per):
            i = s * per + j
            text = "".join(alphabet[(i * 7 + k * 13) % len(alphabet)] for k in range(64))
            rows.append({"id": i, "text": text})
        shards[f"shard-{s:02d}"] = rows
    return shards


def transform(record: dict) -> dict:
    """The per-record work both loaders do: a little string processing, a new dict."""
    text = record["text"]
    return {"id": record["id"], "prefix": text[:8], "vowels": text.count("a") + text.count("e")}


def build(shards: dict[str, list[dict]]) -> zephon.Pipeline:
    dataset = zephon.Dataset.from_dict(
        "bench", {k: zephon.InMemoryShard(v) for k, v in shards.items()}
    )
    source = zephon.StaticMixtureWorkSource(dataset, chunk_size=CHUNK, seed=0)
    return (
        zephon.Pipeline(source)
        .map_transform(transform)
        .shuffle(SHUFFLE)
        .batch(BATCH)
        .options(canonical_replicas=LANES)
    )


class MapDataset:
    """A map-style dataset (``__len__`` and ``__getitem__``) for the DataLoader baseline."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return transform(self.rows[index])


def identity(batch):
    return batch


def dataloader_rate(rows: list[dict]) -> tuple[float, int]:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        MapDataset(rows),
        batch_size=BATCH,
        shuffle=True,
        num_workers=0,
        collate_fn=identity,
        generator=torch.Generator().manual_seed(0),
    )
    start = time.perf_counter()
    count = sum(len(b) for b in loader)
    return count / (time.perf_counter() - start), count


def zephon_rate(shards) -> tuple[float, int]:
    pipeline = build(shards)
    start = time.perf_counter()
    count = sum(len(b) for b in pipeline)
    return count / (time.perf_counter() - start), count


HEAVY_RECORDS = 24_000
HEAVY_CHUNK = 1024
VOCAB = 50_000


def make_heavy_rows() -> dict[str, list[dict]]:
    """Records of 100 words (about 700 characters) drawn from 1,000 made-up words."""
    alphabet = string.ascii_lowercase
    words = ["".join(alphabet[(w * 7 + k * 3) % 26] for k in range(3 + w % 7)) for w in range(1000)]
    per = HEAVY_RECORDS // SHARDS
    shards = {}
    for s in range(SHARDS):
        rows = []
        for j in range(per):
            i = s * per + j
            rows.append(
                {"id": i, "text": " ".join(words[(i * 31 + k * 17) % 1000] for k in range(100))}
            )
        shards[f"shard-{s:02d}"] = rows
    return shards


def tokenize(record: dict) -> dict:
    """A pure-Python tokenizer stand-in: split into words, FNV-1a hash each into a vocabulary.

    CPU-bound and holding the GIL throughout, like a real Python tokenizer; deterministic in
    every process (``hash()`` of a str would not be: it is salted per process).
    """
    ids = []
    for word in record["text"].split():
        h = 2166136261
        for byte in word.encode():
            h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
        ids.append(h % VOCAB)
    return {"id": record["id"], "tokens": ids}


def heavy_rate(shards, parallelism: int) -> tuple[float, int]:
    """Records/s of one full pass with the tokenizer map, from ``iter()`` to the last batch
    (worker start-up included)."""
    dataset = zephon.Dataset.from_dict(
        "heavy", {k: zephon.InMemoryShard(v) for k, v in shards.items()}
    )
    source = zephon.StaticMixtureWorkSource(dataset, chunk_size=HEAVY_CHUNK, seed=0)
    pipeline = (
        zephon.Pipeline(source)
        .map_transform(tokenize)
        .shuffle(SHUFFLE)
        .batch(BATCH)
        .prefetch(8, parallelism=parallelism)
        .options(canonical_replicas=LANES)
    )
    start = time.perf_counter()
    count = sum(len(b) for b in pipeline)
    elapsed = time.perf_counter() - start
    pipeline.close()
    return count / elapsed, count


def state_after(shards, batches: int) -> dict:
    pipeline = build(shards)
    it = iter(pipeline)
    for _ in range(batches):
        next(it)
    state = pipeline.checkpoint()
    pipeline.close()
    return state


def fresh_first_batch(shards) -> float:
    pipeline = build(shards)
    start = time.perf_counter()
    next(iter(pipeline))
    elapsed = time.perf_counter() - start
    pipeline.close()
    return elapsed


def restore_first_batch(shards, state: dict) -> float:
    pipeline = build(shards)
    start = time.perf_counter()
    pipeline.restore(state)
    next(iter(pipeline))
    elapsed = time.perf_counter() - start
    pipeline.close()
    return elapsed


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    print(f"start        {load()} on {os.cpu_count()} cores")
    shards = make_rows()
    rows = [r for v in shards.values() for r in v]
    repeats = 5

    # Alternate the two so that load from other processes on a shared machine hits both alike.
    dl, zp = [], []
    for _ in range(repeats):
        dl.append(dataloader_rate(rows))
        zp.append(zephon_rate(shards))
    dl_rate = statistics.median(r for r, _ in dl)
    zp_rate = statistics.median(r for r, _ in zp)
    print(f"throughput   DataLoader (baseline)   {dl_rate:12,.0f} records/s")
    print(
        f"             zephon Pipeline         {zp_rate:12,.0f} records/s   "
        f"ratio {zp_rate / dl_rate:.2f} (goal >= 1.0)"
    )

    heavy = make_heavy_rows()
    one, two = [], []
    for _ in range(3):
        one.append(heavy_rate(heavy, 1))
        two.append(heavy_rate(heavy, 2))
    one_rate = statistics.median(r for r, _ in one)
    two_rate = statistics.median(r for r, _ in two)
    assert one[0][1] == two[0][1] == HEAVY_RECORDS
    print(f"CPU-heavy    parallelism=1 (baseline) {one_rate:12,.0f} records/s")
    print(
        f"map          parallelism=2 processes {two_rate:12,.0f} records/s   "
        f"ratio {two_rate / one_rate:.2f} (goal >= 1.5)"
    )

    pipeline = build(shards)
    it = iter(pipeline)
    for _ in range(1000):
        next(it)
    latencies = []
    for _ in range(20):
        start = time.perf_counter()
        state = pipeline.checkpoint()
        latencies.append(time.perf_counter() - start)
    pipeline.close()
    size = len(json.dumps(state).encode())
    print(
        f"checkpoint   after 1,000 batches     {statistics.median(latencies) * 1e3:8.3f} ms "
        f"(goal <= 5 ms), {size:,} bytes (goal <= 8,192)"
    )

    fresh = statistics.median(fresh_first_batch(shards) for _ in range(5))
    print(f"first batch  fresh (baseline)        {fresh * 1e3:8.2f} ms")
    for position in (100, 1000, 4000):
        state = state_after(shards, position)
        restored = statistics.median(restore_first_batch(shards, state) for _ in range(5))
        print(
            f"             restore after {position:>5,}      {restored * 1e3:8.2f} ms   "
            f"ratio {restored / fresh:.2f} (goal <= 2.00)"
        )

    delivered = zp[0][1]
    print(
        f"full pass    records delivered       {delivered:,} of {RECORDS:,}"
        f" (DataLoader: {dl[0][1]:,})"
    )
    print(f"end          {load()}")


if __name__ == "__main__":
    main()
