"""The memory tier's ring on three simulated nodes, and its fence (docs/memory.md): real
``torchrun`` processes, every loss equal to the uninterrupted run's
(``cluster.crash_then_resume``)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.zephon.memory.cluster import (
    CRASH,
    STEPS,
    check_losses,
    crash_then_resume,
    launch,
    spec,
    start_of,
)
from tests.zephon.memory.memory_job import reference_losses

pytestmark = pytest.mark.slow


def test_on_three_nodes_a_lost_node_comes_from_the_next_and_two_adjacent_ones_from_save_dir(
    tmp_path,
):
    """The ring: node 1's part is copied to node 2 only. Losing node 1 alone, its part comes
    from node 2; losing nodes 1 and 2, nobody holds it and save_dir is loaded."""
    from zephon.catalog import Catalog

    alone = tmp_path / "alone"
    catalog_url = f"sqlite:///{alone}/catalog.db"
    start, log = crash_then_resume(
        alone, [alone / f"m{i}" for i in range(3)], lose=[1], catalog_url=catalog_url
    )
    assert start["step"] == CRASH and "/.resume/" in start["url"], log
    with Catalog(catalog_url) as catalog:  # one row per node; step 2 left memory at step 4
        rows = catalog.replicas("mem", step=2, tier="memory")
    assert sorted(row.host.rsplit("/", 1)[-1] for row in rows) == ["m0", "m1", "m2"]
    assert {row.state for row in rows} == {"deleted"}
    both = tmp_path / "both"
    start, log = crash_then_resume(
        both, [both / f"m{i}" for i in range(3)], lose=[1, 2], strip=False
    )
    assert start["step"] == CRASH and start["url"].startswith(str(both / "save_dir")), log


def test_a_stale_attempts_memory_copy_is_never_loaded(tmp_path):
    """Attempt 1 saves step 4 in memory and dies. Attempt 2, on other nodes, resumes from
    step 2 (save_dir's step 4 is gone) and dies before saving: attempt 1's step 4 is no longer
    in the run's history. Attempt 3, back on the first nodes, finds it complete in memory and
    must not load it."""
    memory = [tmp_path / "m0", tmp_path / "m1"]
    first = spec(tmp_path, "first", crash_after=CRASH)
    launch(first, memory, 1, expect=17)
    shutil.rmtree(tmp_path / "save_dir" / "mem" / f"save-{CRASH}")
    second = spec(tmp_path, "second", die_at=CRASH - 1)
    launch(second, [tmp_path / "other0", tmp_path / "other1"], 1, expect=18)
    assert start_of(second)["step"] == CRASH - 2
    third = spec(tmp_path, "third")
    log = launch(third, memory, 1, expect=0)
    start = start_of(third)
    assert start["step"] == CRASH - 2 and "/.resume/" not in start["url"], log
    check_losses(Path(third["out"]), reference_losses(2, STEPS))


def _mib_fetched_for_reads(log: str) -> float:
    found = re.findall(r"([0-9.]+) MiB of what the ranks read fetched from peers", log)
    return float(found[0]) if found else 0.0


def test_a_replaced_node_fetches_what_its_ranks_read_not_the_whole_save(tmp_path):
    """Three nodes, each rank 2 MiB of a table sharded over them (beside the replicated
    model, which DCP saved once, spread over the ranks' files). Node 1 is replaced: it fetches
    its own rank's shard file whole, and of the others only the ranges of the replicated
    items its rank reads; nodes 0 and 2 only such ranges. Fetching whole files, the nodes
    would move at least 6 MiB (node 1 every shard file, nodes 0 and 2 the one they lack)."""
    start, log = crash_then_resume(
        tmp_path, [tmp_path / f"m{i}" for i in range(3)], lose=[1], table_kib=2048
    )
    assert start["step"] == CRASH and "/.resume/" in start["url"], log
    assembled = re.findall(r"assembled from memory, ([0-9.]+) MiB from peers", log)
    assert assembled and float(assembled[0]) < 0.5, log  # the small JSON files only
    assert 2.0 <= _mib_fetched_for_reads(log) < 2.5, log


def test_a_peer_copy_that_cannot_be_fetched_gives_way_to_save_dir(tmp_path):
    """Node 1 is replaced and the copy of its shard that node 2 holds has a flipped byte: the
    fetch of what rank 1 reads fails its CRC32C after the assembly chose the save, and every
    rank goes on from save_dir's copy of the same step, losses unchanged."""
    memory = [tmp_path / f"m{i}" for i in range(3)]
    first = spec(tmp_path, "first", crash_after=CRASH, table_kib=2048)
    launch(first, memory, 1, expect=17)
    shutil.rmtree(memory[1])
    held = max((memory[2] / "mem" / f"save-{CRASH}").rglob("__1_*.distcp"), key=os.path.getsize)
    with open(held, "r+b") as handle:
        handle.seek(os.path.getsize(held) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    second = spec(tmp_path, "second", table_kib=2048)
    log = launch(second, memory, 1, expect=0)
    start = start_of(second)
    assert start["step"] == CRASH and start["url"].startswith(str(tmp_path / "save_dir")), log
    assert "could not fetch what its ranks read" in log and "next tier is loaded" in log, log
    check_losses(Path(second["out"]), reference_losses(3, STEPS))
