"""Merged reads: a run of neighbouring slices of one file is fetched as one stream (one
``preadv`` window after another on local disk, one streamed ranged GET on S3) and every check
of a slice-by-slice read still holds inside it: a byte changed in a slice in the middle of the
run, or a file cut short in the middle of the run, is refused naming the file (and the item).

On moto's S3 the shard GETs are counted through the native client's request observers: a run
longer than the old 16 MiB request bound is now one GET, where it was several.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from tests.conftest import DISK_AND_OBJECT_STORE, make_backend
from tests.zephon.dcp.test_verify import assert_names, flip, rewrite, slices
from zephon import dcp as zd
from zephon.dcp.landing import Landing
from zephon.dcp.read_plan import ReadGroup, SliceRead, group_reads
from zephon.storage import CorruptCheckpointError

RUN = "r"
MIB = 1 << 20


@pytest.fixture(params=DISK_AND_OBJECT_STORE)
def store(request, tmp_path):
    with make_backend(request.param, request, tmp_path).open_store() as opened:
        yield opened


def one_file_state(count: int = 6, floats: int = 64 << 10) -> dict[str, torch.Tensor]:
    """``count`` tensors of ``floats`` float32 each (256 KiB by default): one shard file when
    saved with one writer thread, read back as one merged run."""
    torch.manual_seed(1)
    return {f"t{i}": torch.randn(floats) for i in range(count)}


def save_one_file(store, state) -> None:
    zd.save(state, zd.ZephonStorageWriter(store.run(RUN).begin(1), thread_count=1))


def load(store, state, **kwargs) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    zd.load(target, zd.ZephonStorageReader(store, RUN, 1, **kwargs))
    return target


def test_a_run_of_neighbouring_slices_loads_bit_for_bit(store):
    state = one_file_state()
    save_one_file(store, state)
    assert len({w.file for w in slices(store).values()}) == 1
    for threads in (1, 4):
        loaded = load(store, state, thread_count=threads)
        assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_flipped_byte_in_a_slice_in_the_middle_of_a_merged_run_is_refused(store):
    state = one_file_state()
    save_one_file(store, state)
    where = slices(store)
    middle = sorted(where.values(), key=lambda w: w.offset)[3]
    name = next(k for k, w in where.items() if w is middle)
    rewrite(store, middle.file, flip(middle.offset + middle.length // 2))
    with pytest.raises(CorruptCheckpointError, match=f"crc32c of {name} is") as info:
        load(store, state, thread_count=1)
    assert_names(info.value, store, middle.file)
    unverified = load(store, state, thread_count=1, verify=False)
    assert not torch.equal(unverified[name], state[name])


def test_a_file_cut_short_in_the_middle_of_a_merged_run_is_refused(store):
    state = one_file_state()
    save_one_file(store, state)
    middle = sorted(slices(store).values(), key=lambda w: w.offset)[3]
    rewrite(store, middle.file, lambda data: data[: middle.offset + middle.length // 2])
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError, match="is shorter than its manifest") as info:
            load(store, state, thread_count=1, verify=verify)
        assert_names(info.value, store, middle.file)


def test_a_run_longer_than_the_old_request_bound_is_one_streamed_get(s3_backend):
    # Six 4 MiB tensors in one file: 24 MiB, which the old reader fetched in two GETs of at most
    # 16 MiB (moto then read the object twice); now one GET whose reply is streamed in chunks.
    with s3_backend.open_store() as store:
        native = store.location.backend.native
        assert native is not None
        state = one_file_state(6, MIB)
        save_one_file(store, state)
        seen: list[tuple[str, int, int]] = []
        native.observers.append(lambda *request: seen.append(request))
        loaded = load(store, state, thread_count=1)
        native.observers.clear()
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        shard = [(start, end) for key, start, end in seen if key.endswith(".distcp")]
        ordered = sorted(slices(store).values(), key=lambda w: w.offset)
        assert shard == [(ordered[0].offset, ordered[-1].offset + ordered[-1].length)]


# -- the plan and the landing, without storage ---------------------------------------------------


def read(start: int, length: int, fqn: str = "x") -> SliceRead:
    index = MetadataIndex(fqn, [0])
    req = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), [length])
    return SliceRead(req, "f", start, length, None)


def test_reads_cut_from_one_saved_slice_go_to_separate_groups():
    # Two items of one saved slice (a resharded, verified load reads the whole slice for each):
    # a byte of a group must land in one place only.
    a, b, c = read(0, 100), read(0, 100), read(100, 50)
    groups = group_reads([a, b, c], max_bytes=1 << 30, max_gap=0)
    assert sorted((g.start, g.end, len(g.reads)) for g in groups) == [(0, 100, 1), (0, 150, 2)]


def test_a_landing_puts_each_read_in_its_view_skips_gaps_and_finishes_in_order():
    reads = [read(10, 4), read(14, 0), read(20, 6)]
    group = ReadGroup("f", 10, 26, reads)
    views = [memoryview(bytearray(r.length)) for r in reads]
    finished: list[int] = []
    landing = Landing(group, views, lambda i, crc: finished.append(i))
    stream = bytes(range(10, 26))
    for begin in range(0, len(stream), 3):  # chunks that straddle reads and the gap
        landing.feed(memoryview(stream)[begin : begin + 3])
    assert landing.done and finished == [0, 1, 2]
    assert bytes(views[0]) == bytes(range(10, 14)) and bytes(views[2]) == bytes(range(20, 26))
