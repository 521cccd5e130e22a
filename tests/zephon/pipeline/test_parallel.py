"""Map parallelism in worker processes: the same batches and checkpoints as ``parallelism=1``,
exact restores, no process left behind, and one-line errors from a failing worker."""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import types

import pytest

import zephon
from tests.zephon.pipeline import parallel_maps
from zephon.errors import ConfigError
from zephon.pipeline import PipelineError, operators
from zephon.pipeline.operators import jitter_order


def dataset() -> zephon.Dataset:
    # 3 shards of 700 records: windows of 600 entries (chunks of 100, flush every 3 per lane),
    # bigger than a work unit (512 entries), so units are really sent to the workers
    return zephon.Dataset.from_dict(
        "par",
        {
            f"s{i}": zephon.InMemoryShard([{"n": i * 1000 + j} for j in range(700)])
            for i in range(3)
        },
    )


def build(parallelism=None, *maps, batch=5, workers="processes") -> zephon.Pipeline:
    p = zephon.Pipeline(zephon.StaticMixtureWorkSource(dataset(), chunk_size=100, seed=4))
    for fn in maps or (parallel_maps.drop_runs, parallel_maps.annotate):
        p.map_transform(fn)
    p.shuffle(40, seed=1).batch(batch, drop_last=False)
    if parallelism:
        p.prefetch(3, parallelism=parallelism, workers=workers)
    return p.options(canonical_replicas=2, flush_every_k_chunks=3)


def trace(pipeline: zephon.Pipeline, limit: int | None = None) -> list[tuple]:
    """Each batch (lane, payloads, keys) with the checkpoint taken right after it."""
    out = []
    for batch in pipeline:
        out.append((batch.lane, batch.payloads, batch.keys, pipeline.checkpoint()))
        if limit is not None and len(out) == limit:
            break
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    stat = handle.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def test_maps_run_in_other_processes():
    pids = {r["pid"] for b in build(2, parallel_maps.tag_pid) for r in b.payloads}
    assert os.getpid() not in pids and len(pids) == 2


def test_worker_processes_deliver_the_same_batches_and_checkpoints_as_parallelism_1():
    reference = trace(build())
    got = trace(build(2))
    assert len(got) == len(reference) > 200
    assert got == reference


def test_checkpoint_and_restore_with_worker_processes_are_exact():
    reference = trace(build())
    p = build(2)
    first = trace(p, limit=97)  # mid-window, lane cursors inside a work unit
    state = json.loads(json.dumps(p.checkpoint()))
    p.close()
    assert first == reference[:97]

    serial, parallel = build(), build(2)
    serial.restore(state)
    parallel.restore(state)
    assert parallel.checkpoint() == state
    rest = trace(parallel)
    assert rest == trace(serial)  # batches and every checkpoint after them
    assert [b[:3] for b in first + rest] == [b[:3] for b in reference]

    other = build(2, batch=7)  # another microbatch size: other unit boundaries after restore
    other.restore(state)
    resumed = first + trace(other)

    def per_lane(batches):
        pairs = [(k, r) for b in batches for k, r in zip(b[2], b[1], strict=True)]
        return [[(k, r) for k, r in pairs if k[0] == lane] for lane in (0, 1)]

    assert per_lane(resumed) == per_lane(reference)


def test_close_ends_every_worker_process():
    p = build(2, parallel_maps.tag_pid)
    it = iter(p)
    pids = {r["pid"] for _ in range(4) for r in next(it).payloads}
    server = {parent_of(pid) for pid in pids}
    assert all(alive(pid) for pid in pids)
    p.close()
    assert not any(alive(pid) for pid in pids)
    assert not any(children_of(s) for s in server if s != os.getpid())  # a fork server's


def test_garbage_collection_ends_every_worker_process():
    p = build(2, parallel_maps.tag_pid)
    it = iter(p)
    pids = {r["pid"] for r in next(it).payloads}
    assert pids and all(alive(pid) for pid in pids)
    del it, p
    gc.collect()
    assert not any(alive(pid) for pid in pids)


def test_a_failing_map_in_a_worker_is_a_one_line_error_naming_the_operator():
    p = build(2, parallel_maps.annotate, parallel_maps.boom)
    with pytest.raises(PipelineError) as info:
        list(p)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "map_transform tests.zephon.pipeline.parallel_maps.boom (operator 2 of the chain): "
        "ValueError: record 250 is bad and this is its second line in a map worker process"
    )
    assert "workers='threads'" in message
    assert 'raise ValueError(f"record' in str(info.value.__cause__)  # the worker's traceback


def test_a_function_a_process_cannot_load_runs_on_threads_with_a_warning():
    reference = trace(build(None, lambda r: {**r, "k": 1}))
    with pytest.warns(RuntimeWarning, match=r"<lambda> cannot be sent to a worker process"):
        got = trace(build(2, lambda r: {**r, "k": 1}))
    assert got == reference


def test_a_function_that_pickles_but_a_worker_cannot_import_is_a_one_line_error(monkeypatch):
    module = types.ModuleType("zephon_test_made_up_module")  # in sys.modules here, nowhere else
    exec("def double(r):\n    return {**r, 'n2': r['n'] * 2}\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(PipelineError) as info:
        list(build(2, module.double))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("map functions cannot be loaded in a worker process (")
    assert "zephon_test_made_up_module" in message and "workers='threads'" in message


def test_threads_can_be_chosen_and_give_the_same_output():
    assert trace(build(2, workers="threads")) == trace(build())


def test_prefetch_names_the_allowed_workers():
    with pytest.raises(ConfigError, match="prefetch workers must be 'processes' or 'threads'"):
        build().prefetch(2, parallelism=2, workers="fork")


@pytest.mark.parametrize("with_numpy", [True, False])
def test_jitter_order_is_the_sort_by_i_plus_a_scaled_draw(with_numpy, monkeypatch):
    if with_numpy:
        pytest.importorskip("numpy")
    else:
        monkeypatch.setattr(operators, "_NUMPY", [None])
    seeds = [
        0,
        1,
        7,
        2**32 - 1,
        2**32,
        2**64 - 1,
        *(random.Random(k).getrandbits(64) for k in range(20)),
    ]
    cases = [(0, 5, 1), (1, 5, 1), (50, 1, 3), (2, 2, 0), (5000, 1024, 2)]
    cases += [(1000, size, seed) for seed in seeds for size in (2, 7, 1024)]
    for n, size, seed in cases:
        draw = random.Random(seed).random
        keys = [i + draw() * size for i in range(n)]
        expected = sorted(range(n), key=keys.__getitem__) if size > 1 else list(range(n))
        assert jitter_order(n, size, seed) == expected, (n, size, seed)
