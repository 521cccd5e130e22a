"""One rank of the drop-in local tier tests: ``python -m tests.zephon.dcp.dropin_tier_worker
RANK WORLD PORT``, started by ``tests.ranks.launch``. Configuration: ``url`` the save_dir,
``storage_options``, ``catalog``, ``local`` the local root,
``shared`` whether every rank uses that one directory, else ``<local>/rank<r>``).

Steps, every rank through ``zephon.dcp.Writer(local_dir=)`` and torch DCP:
  1  dcp.save;  2 zephon.dcp.async_save on a group of its own
  3  the last rank's files fail while written: refused everywhere, its upload never happens
  4  zephon.dcp.save; then wait_uploads, and Reader(step=None, local_dir=) loads the latest
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.ranks import serve
from tests.zephon.dcp.dropin_worker import FailingWriter, attempt, empty_at, equal, state_at
from zephon import dcp as zd

RUN = "dropin-tier"


def scenario(rank: int, world: int, config: dict) -> dict:
    out: dict = {}
    url = f"{config['url']}/{RUN}"
    local = config["local"] if config["shared"] else f"{config['local']}/rank{rank}"
    kwargs = {"catalog": config["catalog"], "storage_options": config["storage_options"]}
    cls = FailingWriter if rank == world - 1 else zd.Writer
    writer = cls(url, thread_count=2, local_dir=local, **kwargs)
    writer.fail = False
    dcp.save(state_at(1, rank), storage_writer=writer, checkpoint_id=f"{url}/save-1")
    group = dist.new_group(backend="gloo")
    zd.async_save(
        state_at(2, rank), writer, process_group=group, checkpoint_id=f"{url}/save-2"
    ).result(timeout=120)
    writer.fail = True
    out["write_failure"] = attempt(
        lambda: zd.save(state_at(3, rank), writer, checkpoint_id=f"{url}/save-3")
    )
    writer.fail = False
    zd.save(state_at(4, rank), writer, checkpoint_id=f"{url}/save-4")
    out["upload_error"] = attempt(writer.wait_uploads)
    out["committed"] = writer.committed_steps
    dist.barrier()
    reader = zd.Reader(url, local_dir=local, **kwargs)
    target = empty_at(rank)
    dcp.load(target, storage_reader=reader)
    out["latest_step"] = reader.step
    out["from_local"] = reader.from_local
    out["latest_equal"] = equal(target, state_at(4, rank))
    reader.close()
    writer.close()
    return out


if __name__ == "__main__":
    serve(scenario)
