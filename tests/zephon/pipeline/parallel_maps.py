"""Map functions for the worker-process tests: module level, so a new process can load them.

This module imports nothing of zephon's, so loading it in a worker costs little.
"""

from __future__ import annotations

import os


def drop_runs(record: dict) -> dict | None:
    """Drops runs of 7 consecutive ids in every 21: whole microbatches of a window vanish."""
    return None if (record["n"] // 7) % 3 == 0 else record


def annotate(record: dict) -> dict:
    return {**record, "k": record["n"] * 3}


def tag_pid(record: dict) -> dict:
    """Not deterministic on purpose: tells which process mapped the record."""
    return {**record, "pid": os.getpid()}


def boom(record: dict) -> dict:
    if record["n"] == 250:
        raise ValueError(f"record {record['n']} is bad\nand this is its second line")
    return record
