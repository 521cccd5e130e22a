"""Bounded memory on object stores, on moto's real S3 server: uploads go out in parts of the
store's ``part_size`` however large one write is, and a load fetches a slice larger than
``max_request_bytes`` in ranged GETs of at most that size, still checking its CRC32C.

What each request carries is read from the real client's own event hooks (the request that is
sent), so these tests hold the memory model that ``docs/dcp.md`` describes without needing a big
state: a file being uploaded buffers about one part, a reader thread one request.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.s3_calls import S3Calls
from tests.zephon.dcp.test_verify import RecordObjectGets, flip, rewrite, slices
from zephon import dcp as zd
from zephon.storage import CorruptCheckpointError
from zephon.storage.checksum import crc32c_extend, crc32c_of

MIB = 1 << 20
PART = 5 * MIB  # S3's smallest part
RUN = "r"


class RecordUploadParts(S3Calls):
    """The body size of every UploadPart (and PutObject) an s3fs filesystem sends."""

    def __init__(self, fs) -> None:
        super().__init__(fs)
        self.parts: list[int] = []
        self.puts: list[int] = []

    def on_call(self, model, params):
        if model.name in {"UploadPart", "PutObject"}:
            body = params["body"]  # bytes, or botocore's file object over them
            if hasattr(body, "seek"):
                here = body.tell()
                size = body.seek(0, 2) - here
                body.seek(here)
            else:
                size = len(body)
            (self.parts if model.name == "UploadPart" else self.puts).append(size)


@pytest.mark.parametrize(
    ("writes", "parts"),
    [
        ([23 * MIB], [PART] * 4 + [3 * MIB]),  # one tensor-sized write
        ([3 * MIB, 9 * MIB, 1 * MIB, 7 * MIB], [PART] * 4),  # writes across part borders
    ],
)
def test_an_upload_buffers_one_part_however_large_a_write(s3_backend, writes, parts):
    s3_backend.storage_options["native"] = False  # observes s3fs's own requests
    data = bytes(range(256)) * (sum(writes) // 256)
    with s3_backend.open_store(part_size=PART) as store:
        writer = store.run(RUN).begin(1)
        with RecordUploadParts(store.location.fs) as sent, writer.open("big.bin") as out:
            position = 0
            for i, size in enumerate(writes):
                piece = memoryview(data)[position : position + size]
                # alternately with and without a CRC computed by the caller
                out.write(piece, crc=crc32c_extend(0, piece) if i % 2 else None)
                position += size
        assert sent.parts == parts
        manifest = writer.commit()
        entry = manifest.file("big.bin")
        assert (entry.size, entry.crc32c) == (len(data), crc32c_of(data))
        assert store.run(RUN).reader(1).read_bytes("big.bin") == data


def big_state() -> dict:
    torch.manual_seed(0)
    return {"big": torch.randn(1024, 1024), "small": torch.randn(16, 16)}


def shard_ranges(gets: RecordObjectGets) -> list[tuple[int, int]]:
    """(first, last) byte of every GET of a shard file, from its Range header."""
    found = []
    for key, header in gets.calls:
        if key.endswith(".distcp"):
            match = re.fullmatch(r"bytes=(\d+)-(\d+)", header or "")
            assert match is not None, f"a shard was read without a range: {key} {header}"
            found.append((int(match.group(1)), int(match.group(2))))
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_slice_larger_than_a_request_is_streamed_in_bounded_ranges(s3_backend, dtype):
    # float32: straight into the destination; float64: through one buffer, then converted
    s3_backend.storage_options["native"] = False  # observes s3fs's own requests
    with s3_backend.open_store() as store:
        state = big_state()
        zd.save(state, zd.ZephonStorageWriter(store.run(RUN).begin(1), thread_count=1))
        where = slices(store)["big"]
        target = {k: torch.zeros_like(v, dtype=dtype) for k, v in state.items()}
        with RecordObjectGets(store.location.fs) as gets:
            zd.load(target, zd.ZephonStorageReader(store, RUN, 1, max_request_bytes=MIB))
        for key, value in state.items():
            assert torch.equal(target[key], value.to(dtype)), key
        ranges = shard_ranges(gets)
        assert all(last - first + 1 <= MIB for first, last in ranges)
        big = sorted(r for r in ranges if where.offset <= r[0] < where.offset + where.length)
        assert len(big) == 4
        assert big[0][0] == where.offset and big[-1][1] == where.offset + where.length - 1
        assert all(b[0] == a[1] + 1 for a, b in zip(big, big[1:], strict=False))


def test_a_streamed_slice_is_still_checked_against_its_crc(s3_backend):
    with s3_backend.open_store() as store:
        state = big_state()
        zd.save(state, zd.ZephonStorageWriter(store.run(RUN).begin(1), thread_count=1))
        where = slices(store)["big"]
        rewrite(store, where.file, flip(where.offset + 3 * MIB + 5))  # in the last request
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        with pytest.raises(CorruptCheckpointError) as caught:
            zd.load(target, zd.ZephonStorageReader(store, RUN, 1, max_request_bytes=MIB))
        assert caught.value.path == where.file
        assert caught.value.problems[0].startswith(f"{where.file}: crc32c of big is ")
