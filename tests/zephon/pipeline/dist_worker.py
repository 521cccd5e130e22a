"""One rank of the torch.distributed (gloo) test of ``PipelineStateful`` with DCP.

``python -m tests.zephon.pipeline.dist_worker RANK PORT WORKDIR``: two ranks, two data-parallel
groups, aggregation on local disk; saves with ``dcp.save``, loads into fresh pipelines with
``dcp.load`` and prints, as JSON, the state each rank saw and the batches after the restore.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.zephon.pipeline.agg_worker import build
from zephon import PipelineStateful


def main(rank: int, port: int, workdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        agg = os.path.join(workdir, "agg")
        p = build(rank, 2, 2, agg, {}, "dist", 60)
        it = iter(p)
        for _ in range(3):
            next(it)
        saved = PipelineStateful(p).state_dict()
        dcp.save({"data": PipelineStateful(p)}, checkpoint_id=os.path.join(workdir, "dcp"))
        p.close()

        q = build(rank, 2, 2, agg, {}, "dist", 60)
        dcp.load({"data": PipelineStateful(q)}, checkpoint_id=os.path.join(workdir, "dcp"))
        resumed = iter(q)
        after = [k for _ in range(2) for k in next(resumed).keys]
        q.close()
        print(json.dumps({"saved": saved, "after": after}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
