"""One rank of the multi-process verification test: ``python -m tests.zephon.dcp.verify_worker
RANK WORLD PORT``, started by ``tests.ranks.launch`` with the storage root, as ``worker.py`` is.

Every rank saves the same plain tensor ``w`` (so DCP stores it once, as one slice) and loads it
back into a ``Shard(0)`` DTensor: each rank needs only its own rows of that slice (a resharded,
first-dimension-narrowed read). Then rank 0 flips one byte inside the last rank's rows, and every
rank loads again with and without verification. One line ``RESULT <json>`` per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from tests.ranks import serve
from tests.zephon.dcp.worker import error_record
from zephon import dcp as zd
from zephon.storage import CheckpointStore

RUN = "verify-test"
ROWS_PER_RANK = 16
COLS = 64


def full_tensor(world: int) -> torch.Tensor:
    return torch.arange(world * ROWS_PER_RANK * COLS, dtype=torch.float32).reshape(-1, COLS)


def scenario(rank: int, world: int, config: dict) -> dict:
    with CheckpointStore(config["url"], config["storage_options"]) as store:
        return check(store, rank, world)


def check(store: CheckpointStore, rank: int, world: int) -> dict:
    out: dict = {}
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensor(world)
    primary = store.run(RUN).begin(1) if rank == 0 else None
    writer = zd.attach_ranks(store, RUN, 1, primary)
    zd.save({"w": full.clone()}, zd.ZephonStorageWriter(writer))

    def load(verify: bool) -> torch.Tensor:
        target = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
        zd.load(target, zd.ZephonStorageReader(store, RUN, 1, verify=verify))
        return target["w"].to_local()

    mine = full[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
    out["resharded_equal"] = torch.equal(load(True), mine)

    if rank == 0:
        reader = store.run(RUN).reader(1)
        metadata = zd.decode_metadata(reader.read_bytes("dcp_metadata.json"), where="x")
        (where,) = [s for i, s in metadata.storage_data.items() if i.fqn == "w"]
        assert tuple(where.shape) == tuple(full.shape), where
        # one byte inside the last rank's rows
        victim = where.offset + (world - 1) * ROWS_PER_RANK * COLS * 4 + 7
        path = f"{reader.path}/{where.file}"
        data = bytearray(store.location.fs.cat_file(path))
        data[victim] ^= 0x01
        store.location.fs.pipe_file(path, bytes(data))
        out["file"] = where.file
    dist.barrier()

    try:
        load(True)
        out["verified_flip"] = None
    except Exception as exc:
        out["verified_flip"] = {**error_record(exc), "problems": getattr(exc, "problems", [])}
    loaded = load(False)
    out["unverified_flip_equal"] = torch.equal(loaded, mine)
    dist.barrier()
    return out


if __name__ == "__main__":
    serve(scenario)
