"""The local tier: saves commit into a node-local directory and are uploaded to ``save_dir``
in the background (docs/tiers.md).

- ``config.TierConfig``: its options, checked once;
- ``destination.TieredDestination``: the ``Destination`` the run session chooses with one;
- ``tier.LocalTier``: the local store, its retention and resume candidate;
- ``uploader``, ``upload_protocol``, ``exchange``, ``transfer``: the background upload;
- ``tracking.Tracker``: the catalog's replica rows.

Importing this package imports ``config`` only (no torch); the rest is imported when used.
"""

from zephon.destinations.local.config import TierConfig

__all__ = ["TierConfig"]
