"""One rank of the drop-in Writer/Reader tests: ``python -m tests.zephon.dcp.dropin_worker RANK
WORLD PORT``, started by ``tests.ranks.launch``. Configuration: ``url`` the save_dir,
``storage_options``, ``catalog`` a catalog URL or null, ``scenario`` "main" or "kill".

Ranks use ``torch.distributed.checkpoint`` itself with ``zephon.dcp.Writer``/``Reader`` (the
drop-in path) and print one line ``RESULT <json>`` of what they saw.

main, run ``dropin`` (steps):
  1     dcp.save with Writer(step=1); 2 the same Writer, checkpoint_id=<url>/save-2 (reset)
  3     dcp.async_save (DCP's stager), checkpoint_id; 4 zephon.dcp.async_save with ZephonStager
        (num_to_keep=2: steps 3 and 4 stay)
  load  Reader(step=None) finds 4; checkpoint_id=<url>/save-3 through the same Reader; ranks
        given different steps: refused everywhere
  10+r  ranks disagree on the step, then on the run: refused everywhere, nothing written
  5     the last rank's files fail while written: refused everywhere, no marker
  4     a second Writer (a new attempt) saves a step already committed: CommitConflictError
  6     the first Writer, now fenced out by the second: StaleAttemptError everywhere
kill, run ``dropin``: step 1 saved, then the last rank SIGKILLs itself inside write_data of 2.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from tests.ranks import rank_config, serve
from tests.zephon.dcp.worker import FailingOpen
from zephon import dcp as zd
from zephon.dcp.api import as_zephon_error

RUN = "dropin"


def state_at(step: int, rank: int) -> dict[str, torch.Tensor]:
    """A replicated tensor and a rank-unique one, both derived from the step."""
    return {
        "shared": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step,
        f"rank{rank}": torch.full((rank + 2, 5), float(step * 10 + rank), dtype=torch.float64),
    }


def empty_at(rank: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state_at(0, rank).items()}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def error_record(exc: BaseException, where: str = "") -> dict:
    """What a rank saw: the raw exception's type and, for DCP's, what Zephon translates it to."""
    record = {"raw": type(exc).__name__}
    translated = as_zephon_error(exc, where=where) if isinstance(exc, CheckpointException) else exc
    record.update(
        type=type(translated).__name__,
        message=str(translated),
        is_exception=isinstance(translated, Exception),
    )
    return record


def attempt(fn) -> dict | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - recorded for the test process
        return error_record(exc)
    return None


class FailingWriter(zd.Writer):
    """A Writer whose files fail after 10 bytes on this rank (a full disk)."""

    def _attach(self, target):
        writer = super()._attach(target)
        if not getattr(self, "fail", False):
            return writer
        writer.open = FailingOpen(writer)
        return writer


class KilledWriter(zd.Writer):
    """A Writer whose rank is killed (SIGKILL) after writing its first shard of step 2."""

    def _write_file(self, name, items, planner):
        results = super()._write_file(name, items, planner)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return results


def main_scenario(rank: int, world: int, config: dict) -> dict:
    root, options, catalog = config["url"], config["storage_options"], config["catalog"]
    out: dict = {}
    url = f"{root}/{RUN}"
    last = world - 1
    kwargs = {"catalog": catalog, "storage_options": options}
    cls = FailingWriter if rank == last else zd.Writer
    writer = cls(url, step=1, num_to_keep=2, thread_count=2, **kwargs)
    writer.fail = False
    dcp.save(state_at(1, rank), storage_writer=writer)
    dcp.save(state_at(2, rank), storage_writer=writer, checkpoint_id=f"{url}/save-2")
    group = dist.new_group(backend="gloo")
    future = dcp.async_save(
        state_at(3, rank),
        storage_writer=writer,
        checkpoint_id=f"{url}/save-3",
        process_group=group,
    )
    future.result(timeout=120)
    stager = zd.ZephonStager()
    live = state_at(4, rank)
    future = zd.async_save(
        live, writer, process_group=group, stager=stager, checkpoint_id=f"{url}/save-4"
    )
    for value in live.values():
        value.add_(1000)  # after staging: must not reach the checkpoint
    future.result(timeout=120)
    stager.close()
    out["coordinator_committed"] = writer.committed_steps
    dist.barrier()

    reader = zd.Reader(url, **kwargs)
    target = empty_at(rank)
    dcp.load(target, storage_reader=reader)
    out["latest_step"] = reader.step
    out["latest_equal"] = equal(target, state_at(4, rank))
    target = empty_at(rank)
    dcp.load(target, storage_reader=reader, checkpoint_id=f"{url}/save-3")
    out["reset_step"] = reader.step
    out["reset_equal"] = equal(target, state_at(3, rank))
    reader.close()
    split = zd.Reader(url, step=3 if rank == 0 else 4, **kwargs)
    out["reader_disagreement"] = attempt(lambda: zd.load(empty_at(rank), split))
    split.close()

    # ranks disagree: on the step, then on the run
    other = zd.Writer(url, step=10 + rank, **kwargs)
    out["step_disagreement"] = attempt(lambda: dcp.save(state_at(10, rank), storage_writer=other))
    out["step_disagreement_zd"] = attempt(lambda: zd.save(state_at(10, rank), other))
    moved = zd.Writer(f"{root}/{RUN}-{rank}", step=10, **kwargs)
    out["run_disagreement"] = attempt(lambda: dcp.save(state_at(10, rank), storage_writer=moved))
    dist.barrier()

    # the last rank's disk fills up while writing step 5
    writer.fail = True
    out["write_failure"] = attempt(
        lambda: zd.save(state_at(5, rank), writer, checkpoint_id=f"{url}/save-5")
    )
    dist.barrier()

    # a second Writer is a new attempt: a committed step is refused, and the first is fenced out
    # (the same job's retention: a Writer's retention is the run's policy, None included)
    second = zd.Writer(url, step=4, num_to_keep=2, **kwargs)
    out["conflict"] = attempt(lambda: zd.save(state_at(4, rank), second))
    out["stale"] = attempt(
        lambda: zd.save(state_at(6, rank), writer, checkpoint_id=f"{url}/save-6")
    )
    dist.barrier()
    for w in (writer, other, moved, second):
        w.close()
    return out


def kill_scenario(rank: int, world: int, config: dict) -> dict:
    url = f"{config['url']}/{RUN}"
    cls = KilledWriter if rank == world - 1 else zd.Writer
    writer = cls(url, step=1, catalog=config["catalog"], storage_options=config["storage_options"])
    dcp.save(state_at(1, rank), storage_writer=writer)
    out: dict = {"saved": [1]}
    out["killed_save"] = attempt(
        lambda: dcp.save(state_at(2, rank), storage_writer=writer, checkpoint_id=f"{url}/save-2")
    )
    return out


def main() -> None:
    kill = rank_config()["scenario"] == "kill"
    scenario = kill_scenario if kill else main_scenario
    # a process group that lost a rank (kill) cannot be torn down
    serve(scenario, timeout=20 if kill else 90, teardown=not kill)


if __name__ == "__main__":
    main()
