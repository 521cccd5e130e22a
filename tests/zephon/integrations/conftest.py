"""The torchtitan tests run in an environment of their own (``.ci/torchtitan``: torchtitan pins
``datasets<4.8``, which caps fsspec below the main environment's). Elsewhere they are not
collected at all, rather than reported as skipped."""

from __future__ import annotations

import importlib.util
import os

collect_ignore = (
    []
    if os.environ.get("ZEPHON_REQUIRE_TORCHTITAN") == "1" or importlib.util.find_spec("torchtitan")
    else ["test_torchtitan.py"]
)
