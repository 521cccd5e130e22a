"""Which memory save a resume can use, from what every node holds (docs/tiers.md, "Resuming
from memory"): the newest save whose rank 0 marker and every rank's record are held
somewhere, and whose every file is held, with its size, on some node that is still there.

Pure functions of the nodes' holdings (``records.scan`` on each node, all-gathered), so every
rank reaches the same answer without another collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from zephon.destinations.memory.records import Holding, NodeHoldings
from zephon.storage import FileEntry, Manifest, StorageError

__all__ = ["Candidate", "choose", "sources"]


@dataclass(frozen=True)
class Candidate:
    """A memory save every file of which some node holds."""

    step: int
    save_id: str
    #: rank 0's commit marker: the save's epoch (judged by the run's lineage), its metadata
    manifest: Manifest
    #: every file of the save, rank 0's node's and every rank's record's
    files: dict[str, FileEntry]
    #: for each file, the nodes holding it with its size, in node order
    holders: dict[str, list[int]]
    #: the world size that saved it
    world_size: int

    def held_by(self, node: int) -> bool:
        """Whether ``node`` holds every file (a resume there reads no other node)."""
        return all(node in nodes for nodes in self.holders.values())


def choose(nodes: list[NodeHoldings]) -> Candidate | None:
    """The newest save that the nodes hold in full between them (None: no such save)."""
    saves: dict[tuple[int, str], list[tuple[int, Holding]]] = {}
    for node, holdings in enumerate(nodes):
        for holding in holdings:
            saves.setdefault((holding.step, holding.save_id), []).append((node, holding))
    for step, save_id in sorted(saves, reverse=True):
        candidate = _complete(step, save_id, saves[(step, save_id)])
        if candidate is not None:
            return candidate
    return None


def _complete(step: int, save_id: str, held: list[tuple[int, Holding]]) -> Candidate | None:
    manifest = _marker(step, save_id, held)
    if manifest is None:
        return None
    records: dict[int, dict] = {}
    for _, holding in held:
        records.update(holding.records)
    first = records.get(0)
    if first is None:
        return None
    world_size = first["world_size"]
    if any(rank not in records for rank in range(world_size)):
        return None
    files: dict[str, FileEntry] = {entry.name: entry for entry in manifest.files}
    for record in records.values():
        for data in record["files"]:
            entry = FileEntry(**data)
            if files.setdefault(entry.name, entry) != entry:
                return None  # two ranks disagree about one file: not a save to trust
    holders: dict[str, list[int]] = {}
    for name, entry in files.items():
        nodes = [node for node, holding in held if holding.files.get(name) == entry.size]
        if not nodes:
            return None
        holders[name] = nodes
    return Candidate(step, save_id, manifest, files, holders, world_size)


def _marker(step: int, save_id: str, held: list[tuple[int, Holding]]) -> Manifest | None:
    for _, holding in held:
        if holding.marker is None:
            continue
        try:
            manifest = Manifest.from_json(holding.marker.encode("utf-8"), where=f"save-{step}")
        except (StorageError, ValueError):
            continue
        if manifest.step == step and manifest.payload == save_id:
            return manifest
    return None


def sources(candidate: Candidate, node: int, nodes: int) -> dict[str, int]:
    """For ``node``: each file of ``candidate`` and the node it comes from: itself when it
    holds it, else the nearest holder after it in the ring (the peer that got its copy)."""
    chosen: dict[str, int] = {}
    for name, holders in candidate.holders.items():
        if node in holders:
            chosen[name] = node
        else:
            chosen[name] = min(holders, key=lambda holder: (holder - node) % nodes)
    return chosen
