"""The memory tier's ring on three simulated nodes, and its fence (docs/memory.md): real
``torchrun`` processes, every loss equal to the uninterrupted run's
(``cluster.crash_then_resume``)."""

from __future__ import annotations

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
