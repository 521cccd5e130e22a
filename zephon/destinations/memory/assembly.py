"""A resume from memory (docs/memory.md, "Resuming from memory"): every node's leader lists
what its memory directory holds, every rank chooses the same save from the all-gathered
listings (``choice.choose``), and every node assembles it into ``<memory_dir>/.resume`` in
two steps:

1. ``assemble``: the files the node holds itself are linked (no copy); of the others, every
   file but the DCP shard files (the small JSON files a load plans from) is fetched from the
   nearest peer that holds it, checked against its CRC32C as it arrives, and each shard file
   gets a placeholder (``Assembly.hold_place``); a marker listing every file of the save is
   written last.
2. ``fetch_reads``, once every rank knows what its load will read (``dcp.api.ranges_read``):
   what the node's ranks read of the shard files it does not hold, from the same peers: a file
   they read for the most part whole is streamed whole and checked by its CRC32C, the items
   they read of other files are fetched as byte ranges into the placeholder (the load checks
   each item's CRC32C). Nothing else crosses the network: the nodes of a job restarting where
   it ran read their own parts whatever their number, and a replacement node fetches its own
   ranks' part and the few items they read of others' files (replicated values that DCP saved
   once), not the whole save.

The loader then reads that store on every rank, checking every byte again. What no rank of a
node reads is listed by its marker there but never fetched; what reads a whole save (rank 0
uploading a step save_dir missed) asks for every file whole.

A node that cannot assemble (a peer gone during the fetch, a file that fails its checksum)
makes the whole job fall back to the next tier.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from zephon.collectives import Collectives
from zephon.destinations.memory.choice import Candidate, choose, sources
from zephon.destinations.memory.records import Holding, scan
from zephon.destinations.memory.tier import MemoryTier
from zephon.errors import CopyUnavailableError
from zephon.storage import CheckpointStore, redact

__all__ = [
    "FETCH_THREADS",
    "SHARD_SUFFIX",
    "Assembly",
    "assemble",
    "fetch_reads",
    "merge_spans",
]

log = logging.getLogger("zephon")

#: files one node fetches from its peers at once
FETCH_THREADS = 4
#: a DCP shard file's name ends so: fetched only for a rank that reads it (``fetch_reads``)
SHARD_SUFFIX = ".distcp"
#: ranges of one file this close are fetched as one
MERGE_GAP_BYTES = 1 << 20
#: the most bytes one range request asks for
RANGE_BYTES = 16 << 20


@dataclass
class Assembly:
    """A node's assembled store of a save, as far as it is: where its files go, and the shard
    files it has not placed yet with the node each comes from."""

    candidate: Candidate
    #: the save's payload directory relative to a memory directory (the name peers know)
    relative_payload: str
    #: this node's directory of the save's files in the assembled store
    target: str
    #: every file of the save -> the node it comes from (this one if it holds it)
    chosen: dict[str, int]
    #: shard files not placed yet
    pending: set[str] = field(default_factory=set)

    def place(self, tier: MemoryTier, name: str) -> int:
        """One file into the assembled store: linked from this node's own memory, else
        fetched from the nearest holder and checked on arrival. Returns the bytes fetched."""
        nodes = tier.nodes
        destination = os.path.join(self.target, *name.split("/"))
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        holder = self.chosen[name]
        if holder == nodes.node:
            memory_root = os.path.realpath(tier.memory_dir)
            source = os.path.join(memory_root, *self.relative_payload.split("/"), *name.split("/"))
            try:
                os.link(source, destination)
            except OSError:
                shutil.copyfile(source, destination)
            return 0
        entry = self.candidate.files[name]
        try:
            nodes.client(holder).fetch_file(
                posixpath.join(self.relative_payload, name), destination, entry.crc32c, entry.size
            )
        except Exception:
            nodes.drop(holder)
            raise
        return entry.size

    def fetch_spans(self, tier: MemoryTier, spans: Mapping[str, Iterable[tuple[int, int]]]) -> int:
        """What the node's ranks read of pending shard files: a file read for the most part
        whole, else its ranges (joined across small gaps, cut into ``RANGE_BYTES`` requests)
        into its placeholder. Returns the bytes fetched."""
        whole, pieces = [], []
        for name, ranges in spans.items():
            merged = merge_spans(ranges, MERGE_GAP_BYTES)
            size = self.candidate.files[name].size
            if sum(length for _, length in merged) * 2 >= size:
                whole.append(name)
                continue
            for offset, length in merged:
                end = min(offset + length, size)
                pieces += [
                    (name, at, min(RANGE_BYTES, end - at)) for at in range(offset, end, RANGE_BYTES)
                ]
        fetched = self.fetch(tier, whole)
        if pieces:
            with ThreadPoolExecutor(min(FETCH_THREADS, len(pieces)), "zephon-fetch") as pool:
                fetched += sum(pool.map(lambda piece: self._fetch_range(tier, *piece), pieces))
        return fetched

    def _fetch_range(self, tier: MemoryTier, name: str, offset: int, length: int) -> int:
        """``length`` bytes of ``name`` at ``offset`` from its holder, into the placeholder
        (the file stays pending: a later whole fetch replaces it)."""
        holder = self.chosen[name]
        try:
            data = tier.nodes.client(holder).read_range(
                posixpath.join(self.relative_payload, name), offset, length
            )
        except Exception:
            tier.nodes.drop(holder)
            raise
        fd = os.open(os.path.join(self.target, *name.split("/")), os.O_WRONLY)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, memoryview(data)[done:], offset + done)
        finally:
            os.close(fd)
        return length

    def hold_place(self, name: str) -> None:
        """A shard file not fetched yet: an empty file of its size (sparse: no memory), so the
        marker can list every file, until ranges are written into it or ``place`` replaces it.
        A read of what was never fetched finds zeros, which fail the item's CRC32C unless the
        item's bytes are zeros too (and then they are the item's)."""
        destination = os.path.join(self.target, *name.split("/"))
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        with open(destination, "wb") as placeholder:
            placeholder.truncate(self.candidate.files[name].size)

    def fetch(self, tier: MemoryTier, names: Iterable[str]) -> int:
        """These files from their holders, ``FETCH_THREADS`` at once; the bytes fetched."""
        todo = sorted(set(names))
        if not todo:
            return 0
        with ThreadPoolExecutor(min(FETCH_THREADS, len(todo)), "zephon-fetch") as pool:
            fetched = sum(pool.map(lambda name: self.place(tier, name), todo))
        self.pending.difference_update(todo)
        return fetched


def assemble(tier: MemoryTier, coll: Collectives) -> int | None:
    """Collective: the step of the newest memory save the nodes hold in full between them,
    assembled on every node but for the shard files its ranks may not read (``tier.resumed``;
    ``fetch_reads`` brings those), or None (save_dir, or the next tier, is loaded)."""
    began = time.monotonic()
    nodes = tier.nodes
    run_path = tier.store.run(tier.run).run_path()
    listing = [h.to_dict() for h in scan(run_path)] if nodes.leader else None
    everything = coll.all_gather(listing)
    held = [[Holding.from_dict(h) for h in everything[leader] or []] for leader in nodes.leaders]
    candidate = choose(held)
    tier.assembly = None
    if candidate is None:
        return None
    problem: str | None = None
    fetched = 0
    if nodes.leader:
        try:
            tier.assembly, fetched = _build(tier, candidate)
        except Exception as exc:  # noqa: BLE001 - every node must learn it, then save_dir
            problem = _reason(exc)
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


def fetch_reads(
    tier: MemoryTier, coll: Collectives, reads: Mapping[str, Sequence[tuple[int, int]]] | None
) -> None:
    """Collective, after ``assemble`` chose a save: ``reads`` maps the shard files this rank's
    load reads to the byte ranges it reads of each (None: every file whole). Each node's leader
    brings what its ranks read of the shard files it did not have: a file read for the most
    part whole (streamed, its CRC32C checked), the rest as ranges into its placeholder (each
    item's CRC32C is checked as it loads). Raises ``CopyUnavailableError`` on every rank if a
    node could not."""
    began = time.monotonic()
    nodes = tier.nodes
    wanted = coll.all_gather(None if reads is None else {f: list(s) for f, s in reads.items()})
    problem: str | None = None
    fetched = 0
    assembly = tier.assembly
    if nodes.leader and assembly is not None and assembly.pending:
        mine = [rank for rank, node in enumerate(nodes.node_of) if node == nodes.node]
        try:
            if any(wanted[rank] is None for rank in mine):
                fetched = assembly.fetch(tier, set(assembly.pending))
            else:
                spans: dict[str, list[tuple[int, int]]] = {}
                for rank in mine:
                    for name, ranges in (wanted[rank] or {}).items():
                        if name in assembly.pending:
                            spans.setdefault(name, []).extend(map(tuple, ranges))
                fetched = assembly.fetch_spans(tier, spans)
        except Exception as exc:  # noqa: BLE001 - every node must learn it, then the next tier
            problem = _reason(exc)
    outcomes = coll.all_gather((problem, fetched))
    failed = [(rank, text) for rank, (text, _) in enumerate(outcomes) if text is not None]
    if failed:
        rank, text = failed[0]
        step = tier.resumed.step if tier.resumed is not None else None
        raise CopyUnavailableError(
            f"the node of rank {rank} could not fetch what its ranks read of memory step {step} "
            f"from its peers ({text})"
        )
    moved = sum(size for _, size in outcomes)
    if coll.is_main and moved:
        log.info(
            "zephon: %.1f MiB of what the ranks read fetched from peers in %.2f s",
            moved / 2**20,
            time.monotonic() - began,
        )


def merge_spans(spans: Iterable[tuple[int, int]], gap: int = 0) -> list[tuple[int, int]]:
    """``(offset, length)`` spans sorted and joined where they overlap or lie at most ``gap``
    bytes apart."""
    merged: list[list[int]] = []
    for offset, length in sorted(spans):
        if merged and offset <= merged[-1][0] + merged[-1][1] + gap:
            end = max(merged[-1][0] + merged[-1][1], offset + length)
            merged[-1][1] = end - merged[-1][0]
        else:
            merged.append([offset, length])
    return [(offset, length) for offset, length in merged]


def _build(tier: MemoryTier, candidate: Candidate) -> tuple[Assembly, int]:
    """A node leader: the candidate's files into the assembled store (linked if held here,
    fetched if not and not shard files), then its marker. Returns the assembly, with the shard
    files left to fetch, and the bytes fetched from peers."""
    nodes = tier.nodes
    memory_root = os.path.realpath(tier.memory_dir)
    run_path = os.path.realpath(tier.store.run(tier.run).run_path())
    run_relative = os.path.relpath(run_path, memory_root).replace(os.sep, "/")
    save = f"save-{candidate.step}/{candidate.save_id}"
    relative_payload = save if run_relative == "." else posixpath.join(run_relative, save)
    shutil.rmtree(tier.resume_root, ignore_errors=True)
    target = os.path.join(tier.resume_root, *relative_payload.split("/"))
    os.makedirs(target, exist_ok=True)
    assembly = Assembly(
        candidate, relative_payload, target, sources(candidate, nodes.node, nodes.count)
    )
    remote = []
    for name, holder in assembly.chosen.items():
        if holder == nodes.node:
            assembly.place(tier, name)
        elif name.endswith(SHARD_SUFFIX):
            assembly.pending.add(name)
            assembly.hold_place(name)
        else:
            remote.append(name)
    fetched = assembly.fetch(tier, remote)
    store = CheckpointStore(tier.resume_root, role="memory_dir")
    try:
        writer = store.run(tier.run).begin(candidate.step, save_id=candidate.save_id)
        writer.add_entries(candidate.files.values())
        writer.commit(metadata=candidate.manifest.metadata)
    finally:
        store.close()
    return assembly, fetched


def _reason(exc: BaseException) -> str:
    return redact(f"{type(exc).__name__}: {exc}").splitlines()[0][:300]
