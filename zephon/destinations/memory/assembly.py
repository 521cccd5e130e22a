"""A resume from memory (docs/tiers.md, "Resuming from memory"): every node's leader lists
what its memory directory holds, every rank chooses the same save from the all-gathered
listings (``choice.choose``), and every node assembles it into ``<memory_dir>/.resume``:
the files it holds itself are linked (no copy), the others fetched from the nearest peer that
holds them, each checked against its CRC32C as it arrives, and a marker listing every file is
written last. The loader then reads that store on every rank, checking every byte again.

A node that cannot assemble (a peer gone during the fetch, a file that fails its checksum)
makes the whole job fall back to the next tier: every node must hold the save in full.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

from zephon.collectives import Collectives
from zephon.destinations.memory.choice import Candidate, choose, sources
from zephon.destinations.memory.records import Holding, scan
from zephon.destinations.memory.tier import MemoryTier
from zephon.storage import CheckpointStore, redact

__all__ = ["FETCH_THREADS", "assemble"]

log = logging.getLogger("zephon")

#: files one node fetches from its peers at once
FETCH_THREADS = 4


def assemble(tier: MemoryTier, coll: Collectives) -> int | None:
    """Collective: the step of the newest memory save every node now holds in full in its
    assembled store (``tier.resumed``), or None (save_dir, or the next tier, is loaded)."""
    began = time.monotonic()
    nodes = tier.nodes
    run_path = tier.store.run(tier.run).run_path()
    listing = [h.to_dict() for h in scan(run_path)] if nodes.leader else None
    everything = coll.all_gather(listing)
    held = [[Holding.from_dict(h) for h in everything[leader] or []] for leader in nodes.leaders]
    candidate = choose(held)
    if candidate is None:
        return None
    problem: str | None = None
    fetched = 0
    if nodes.leader:
        try:
            fetched = _build(tier, candidate)
        except Exception as exc:  # noqa: BLE001 - every node must learn it, then save_dir
            problem = redact(f"{type(exc).__name__}: {exc}").splitlines()[0][:300]
    outcomes = coll.all_gather((problem, fetched))
    failed = [(rank, text) for rank, (text, _) in enumerate(outcomes) if text is not None]
    if failed:
        if coll.is_main:
            rank, text = failed[0]
            log.warning(
                "zephon: step %d is in memory but node of rank %d could not assemble it (%s); "
                "resuming from save_dir",
                candidate.step,
                rank,
                text,
            )
        return None
    tier.resumed = candidate
    tier.resume_store = CheckpointStore(tier.resume_root, role="memory_dir")
    if coll.is_main:
        moved = sum(size for _, size in outcomes)
        where = "own memory" if moved == 0 else f"memory, {moved / 2**20:.1f} MiB from peers"
        log.info(
            "zephon: step %d assembled from %s in %.2f s",
            candidate.step,
            where,
            time.monotonic() - began,
        )
    return candidate.step


def _build(tier: MemoryTier, candidate: Candidate) -> int:
    """A node leader: the candidate's files into the assembled store (linked or fetched),
    then its marker. Returns the bytes fetched from peers."""
    nodes = tier.nodes
    memory_root = os.path.realpath(tier.memory_dir)
    run_path = os.path.realpath(tier.store.run(tier.run).run_path())
    run_relative = os.path.relpath(run_path, memory_root).replace(os.sep, "/")
    save = f"save-{candidate.step}/{candidate.save_id}"
    relative_payload = save if run_relative == "." else posixpath.join(run_relative, save)
    shutil.rmtree(tier.resume_root, ignore_errors=True)
    target = os.path.join(tier.resume_root, *relative_payload.split("/"))
    own = os.path.join(memory_root, *relative_payload.split("/"))
    chosen = sources(candidate, nodes.node, nodes.count)
    fetched = 0

    def place(name: str) -> int:
        entry = candidate.files[name]
        destination = os.path.join(target, *name.split("/"))
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        holder = chosen[name]
        if holder == nodes.node:
            source = os.path.join(own, *name.split("/"))
            try:
                os.link(source, destination)
            except OSError:
                shutil.copyfile(source, destination)
            return 0
        client = nodes.client(holder)
        try:
            client.fetch_file(
                posixpath.join(relative_payload, name), destination, entry.crc32c, entry.size
            )
        except Exception:
            nodes.drop(holder)
            raise
        return entry.size

    os.makedirs(target, exist_ok=True)
    remote = [name for name, holder in chosen.items() if holder != nodes.node]
    for name, holder in chosen.items():
        if holder == nodes.node:
            place(name)
    if remote:
        with ThreadPoolExecutor(min(FETCH_THREADS, len(remote)), "zephon-fetch") as pool:
            fetched = sum(pool.map(place, remote))
    store = CheckpointStore(tier.resume_root, role="memory_dir")
    try:
        writer = store.run(tier.run).begin(candidate.step, save_id=candidate.save_id)
        writer.add_entries(candidate.files.values())
        writer.commit(metadata=candidate.manifest.metadata)
    finally:
        store.close()
    return fetched
