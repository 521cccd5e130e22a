"""Where a job's saves go: the one decision a run session makes once, and the one interface
the checkpoint manager and ``zephon.dcp.Writer`` save and resume through (docs/tiers.md).

- ``direct.DirectDestination``: a save commits straight into ``save_dir``; rank 0 then
  records the catalog row and applies retention;
- ``local.destination.TieredDestination`` (``local_dir``): a save commits into a node-local
  directory and returns; every rank's uploader copies it to ``save_dir`` in the background;
- ``memory.destination.MemoryDestination`` (``memory_tier``): a save commits into host memory
  on every node and returns; in the background each rank copies its part to peer nodes, then
  uploads it to ``save_dir``; a resume assembles the fastest verified copies; with a
  ``local_dir`` too, ``memory.durable.DurableMemoryDestination`` copies each save there
  before its upload, and a resume whose memory is gone reads it.

This package sits below both ``zephon.checkpointing`` and ``zephon.dcp`` and imports neither
(tests/test_layers.py). Importing it imports only the contract and ``TierConfig`` (the job
config composes it, so it must not import the save path back); the destinations themselves
are imported when chosen, the local tier's torch.distributed only when a job has one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zephon.destinations.base import Destination
from zephon.destinations.local.config import TierConfig

if TYPE_CHECKING:
    from zephon.collectives import Collectives
    from zephon.session import RunSession

__all__ = [
    "Destination",
    "DirectDestination",
    "TierConfig",
    "TieredDestination",
    "choose_destination",
]


def choose_destination(
    session: RunSession, tier: TierConfig | None = None, coll: Collectives | None = None
) -> Destination:
    """The destination of ``session``'s saves: the memory tier with ``tier.memory_tier`` (and
    ``local_dir`` behind it if set), the local tier when ``tier`` names a ``local_dir`` (both
    collective: construct on every rank at the same point, ``coll`` the job's process group),
    else direct."""
    if tier is None or not tier.enabled:
        from zephon.destinations.direct import DirectDestination

        return DirectDestination(session)
    if coll is None:
        raise ValueError("a tiered destination needs the job's process group (coll)")
    if tier.memory_tier and tier.local_dir is not None:
        from zephon.destinations.memory.durable import DurableMemoryDestination

        return DurableMemoryDestination(session, tier, coll)
    if tier.memory_tier:
        from zephon.destinations.memory.destination import MemoryDestination

        return MemoryDestination(session, tier, coll)
    from zephon.destinations.local.destination import TieredDestination

    return TieredDestination(session, tier, coll)


def __getattr__(name: str) -> Any:
    """``DirectDestination`` and ``TieredDestination``, imported when first asked for."""
    if name == "DirectDestination":
        from zephon.destinations.direct import DirectDestination

        return DirectDestination
    if name == "TieredDestination":
        from zephon.destinations.local.destination import TieredDestination

        return TieredDestination
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
