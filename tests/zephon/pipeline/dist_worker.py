"""One rank of the torch.distributed (gloo) test of ``PipelineStateful`` with DCP.

``python -m tests.zephon.pipeline.dist_worker RANK 2 PORT``, started by ``tests.ranks.launch``
(configuration: ``workdir``): two ranks, two data-parallel groups, aggregation on local disk;
saves with ``dcp.save``, loads into fresh pipelines with ``dcp.load`` and reports the state each
rank saw and the batches after the restore.
"""

from __future__ import annotations

import os

import torch.distributed.checkpoint as dcp

from tests.ranks import serve
from tests.zephon.pipeline.agg_worker import build
from zephon import PipelineStateful


def scenario(rank: int, world: int, config: dict) -> dict:
    workdir = config["workdir"]
    agg = os.path.join(workdir, "agg")
    p = build(rank, world, 2, agg, {}, "dist", 60)
    it = iter(p)
    for _ in range(3):
        next(it)
    saved = PipelineStateful(p).state_dict()
    dcp.save({"data": PipelineStateful(p)}, checkpoint_id=os.path.join(workdir, "dcp"))
    p.close()

    q = build(rank, world, 2, agg, {}, "dist", 60)
    dcp.load({"data": PipelineStateful(q)}, checkpoint_id=os.path.join(workdir, "dcp"))
    resumed = iter(q)
    after = [k for _ in range(2) for k in next(resumed).keys]
    q.close()
    return {"saved": saved, "after": after}


if __name__ == "__main__":
    serve(scenario)
