"""Streamed writes on the native data path (``NativeWriter`` in storage/backends/native.py):
bytes written in place are queued as they are and sent from their own memory, never copied;
a file of several parts is one multipart upload whose parts go out while it is written;
a discarded file publishes nothing. On S3 (moto) and Azure (Azurite)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_payload
from zephon import dcp as zd

PART = 5 << 20


@pytest.fixture(params=["s3", "azure"])
def object_store(request):
    return request.getfixturevalue(f"{request.param}_backend")


def held(buffer: bytearray) -> bool:
    """Whether something still holds a view of ``buffer`` (a resize is then refused)."""
    try:
        buffer.append(0)
    except BufferError:
        return True
    buffer.pop()
    return False


def test_bytes_written_in_place_are_held_not_copied_until_the_file_is_finished(object_store):
    kept = bytearray(random_payload(PART // 2))
    copied = bytearray(random_payload(1000))
    expected = bytes(kept) + bytes(copied)
    with object_store.open_store(part_size=PART) as store:
        native = store.location.backend.native
        with store.run("r").begin(1) as writer:
            with writer.open("small.bin") as out:
                out.write(kept, in_place=True)
                out.write(copied)
                # the in-place bytes wait in the queue as a view of their own buffer; the
                # others were copied, so their buffer is the caller's again
                assert held(kept) and not held(copied)
            assert not held(kept)  # sent (one PUT below two parts) and let go
            with writer.open("empty.bin"):
                pass
            writer.commit()
        assert native.calls["open_write"] == 2 and "stream_multipart" not in native.calls
        assert store.run("r").reader(1).read_bytes("small.bin") == expected
        assert store.run("r").reader(1).read_bytes("empty.bin") == b""


def test_a_file_of_several_parts_streams_as_one_multipart_upload_from_the_buffers(object_store):
    pieces = [bytearray(random_payload(PART + 123 * i)) for i in range(4)]
    with object_store.open_store(part_size=PART) as store:
        native = store.location.backend.native
        with store.run("r").begin(1) as writer:
            with writer.open("big.bin") as out:
                for piece in pieces:
                    out.write(piece, in_place=True)
            assert not any(held(p) for p in pieces)
            entry = writer.commit().files[0]
        assert native.calls["stream_multipart"] == 1
        assert entry.size == sum(len(p) for p in pieces)
        assert store.run("r").reader(1).read_bytes("big.bin") == b"".join(map(bytes, pieces))
        assert store.run("r").verify(1, deep=True).ok


def test_a_streamed_file_abandoned_mid_upload_publishes_nothing(object_store):
    with object_store.open_store(part_size=PART) as store:
        with store.run("r").begin(1) as writer:
            with pytest.raises(RuntimeError, match="stop here"), writer.open("big.bin") as out:
                for _ in range(3):
                    out.write(random_payload(PART), in_place=True)
                raise RuntimeError("stop here")
            backend = store.location.backend
            target = f"{writer.payload_path}/big.bin"
            assert not backend.file_exists(target)
            with writer.open("big.bin") as out:  # the name may be written again
                out.write(b"again")
            writer.commit()
        assert store.run("r").reader(1).read_bytes("big.bin") == b"again"


def test_dcp_shards_stream_from_tensor_memory_as_multipart_uploads(s3_backend):
    state = {f"w{i}": torch.randn(1 << 20) for i in range(6)}  # 24 MiB, one shard file
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with s3_backend.open_store(part_size=PART) as store:
        native = store.location.backend.native
        writer = zd.attach_ranks(store, "r", 1, store.run("r").begin(1))
        zd.save(state, zd.ZephonStorageWriter(writer, thread_count=1))
        assert native.calls["stream_multipart"] == 1
        zd.load(target, zd.ZephonStorageReader(store, "r", 1))
    assert all(torch.equal(state[k], target[k]) for k in state)
