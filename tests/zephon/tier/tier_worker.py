"""One rank of the local tier's multi-process tests: ``python -m tests.zephon.tier.tier_worker
RANK WORLD PORT``, started by ``tests.ranks.launch``.

The save_dir comes from that launcher's configuration (``url``, ``storage_options``: as
``tests.ranks.store_config`` gives them), the rest from ``ZEPHON_TIER_TEST`` (JSON)::

    {"run": name, "catalog_url": URL or null, "local_dir": path ("{rank}" is replaced by the
     rank: per-node local disks), "local_num_to_keep": 1, "max_pending_uploads": 2,
     "async_save": false, "dedup": false, "sync_dir": directory for the files a test and
     its ranks wait on,
     "script": [[action, arg], ...]}

A rank runs one start (attempt) of a job: a ``CheckpointManager`` with the local tier, and the
script's actions in order, each recorded as ``{"action", "ok": value}`` or ``{"action",
"error": {type, module, message}}`` (a failed action does not stop the script):

    save <step> <tag>      parameters set to the values of (tag, step), then ``manager.save``
    wait                   ``manager.wait()``: every pending upload done (or its failure)
    load <tag>             ``load_latest`` into a model of other values: the step found, its
                           url, whether every tensor equals (tag, step)'s, the plain values
    signal <name>          create ``<sync_dir>/<name>-r<rank>`` (the test waits on it)
    await <name>           wait until the test created ``<sync_dir>/<name>``
    break_uploader <rank>  on that rank, the uploader thread dies in its next upload
    kill                   a barrier, then SIGKILL this process (pending uploads and all)
    close                  ``manager.close()``
    reopen <local_dir>     close the manager and open another with this local_dir (a new
                           start of the job in the same processes: e.g. on fresh local disks)

A script with ``kill`` runs in a child process of this one (same arguments, ``ZEPHON_TIER_CHILD``
set): the child dies as a preempted rank does; this process reports the child's exit code and
what it recorded before dying (one JSON line per action, flushed as it goes). That parent only
waits, so it runs before torch is imported (the imports below it are deliberately late).

Each process prints one line ``RESULT <json>``; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from typing import Any


def run_child() -> dict[str, Any]:
    """Run this rank's script in a child process that will SIGKILL itself; what it did."""
    argv = [sys.executable, "-m", "tests.zephon.tier.tier_worker", *sys.argv[1:]]
    done = subprocess.run(
        argv,
        env={**os.environ, "ZEPHON_TIER_CHILD": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    records = [
        json.loads(line[len("ACTION ") :])
        for line in done.stdout.splitlines()
        if line.startswith("ACTION ")
    ]
    return {"child_returncode": done.returncode, "actions": records, "stderr": done.stderr[-3000:]}


def kills_itself() -> bool:
    script = json.loads(os.environ["ZEPHON_TIER_TEST"])["script"]
    return any(action == "kill" for action, *_ in script)


if __name__ == "__main__" and "ZEPHON_TIER_CHILD" not in os.environ and kills_itself():
    print("RESULT " + json.dumps({"rank": int(sys.argv[1]), **run_child()}), flush=True)
    sys.exit(0)

import torch  # noqa: E402  (after the parent above, which never needs it)
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_module, init_device_mesh  # noqa: E402

from tests.ranks import serve  # noqa: E402
from tests.zephon.dcp.worker import error_record  # noqa: E402
from zephon import CheckpointingConfig, CheckpointManager  # noqa: E402

#: how long ``await`` waits for the test before giving up
AWAIT_TIMEOUT_S = 90
TIMEOUT_S = 90


# -- the model and the values a (tag, step) gives it ----------------------------------------


def build_model(world: int) -> nn.Module:
    """Two linear layers, every parameter a ``Shard(0)`` DTensor over the ranks (so every rank
    writes tensor shards of its own), plain tensors on one rank."""
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))

        def partition(name: str, module: nn.Module, mesh) -> None:
            from torch.distributed.tensor import distribute_tensor

            for key, param in list(module.named_parameters(recurse=False)):
                placed = distribute_tensor(param.data, mesh, [Shard(0)])
                module.register_parameter(key, nn.Parameter(placed))

        distribute_module(model, mesh, partition)
    return model


def expected(tag: str, step: int, name: str, shape: torch.Size) -> torch.Tensor:
    """The whole tensor ``name`` holds after ``save <step> <tag>``."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{step}/{name}".encode()))
    return torch.randn(shape, generator=generator)


def local_part(param: torch.Tensor, whole: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of ``whole`` as ``param`` holds it (``Shard(0)``: torch.chunk)."""
    if isinstance(param, DTensor):
        return whole.chunk(world)[rank]
    return whole


def global_shape(param: torch.Tensor) -> torch.Size:
    return param.shape  # a DTensor's shape is the whole tensor's


def fill(model: nn.Module, tag: str, step: int, rank: int, world: int) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            whole = expected(tag, step, name, global_shape(param))
            target = param.to_local() if isinstance(param, DTensor) else param
            target.copy_(local_part(param, whole, rank, world))


def differing(model: nn.Module, tag: str, step: int, rank: int, world: int) -> list[str]:
    """The parameters whose local piece is not (tag, step)'s."""
    out = []
    for name, param in model.named_parameters():
        whole = expected(tag, step, name, global_shape(param))
        mine = param.to_local() if isinstance(param, DTensor) else param
        if not torch.equal(mine.detach(), local_part(param, whole, rank, world)):
            out.append(name)
    return out


# -- the script --------------------------------------------------------------------------------


class Job:
    """One start of the job on this rank: the manager and the script's actions."""

    def __init__(self, rank: int, world: int, config: dict[str, Any], save_dir: dict) -> None:
        self.rank, self.world, self.config = rank, world, config
        self.sync_dir = config.get("sync_dir")
        self.save_dir = save_dir
        self.model = build_model(world)
        self.manager = self.open(config.get("local_dir"))
        self.closed = False

    def open(self, local_dir: str | None) -> CheckpointManager:
        options: dict[str, Any] = {}
        if local_dir is not None:
            options["local_dir"] = local_dir.replace("{rank}", str(self.rank))
        for key in ("local_num_to_keep", "max_pending_uploads", "async_save", "dedup"):
            if key in self.config:
                options[key] = self.config[key]
        checkpointing = CheckpointingConfig(
            save_dir=self.save_dir["url"],
            storage_options=self.save_dir["storage_options"],
            catalog_url=self.config.get("catalog_url"),
            num_to_keep=self.config.get("num_to_keep"),
            **options,
        )
        return CheckpointManager(checkpointing, run_name=self.config["run"], total_steps=100)

    def state(self, tag: str, step: int) -> dict[str, Any]:
        return {"model": self.model, "extra": {"rank": self.rank, "tag": tag, "step": step}}

    def run(self, script: list[list[Any]], log) -> list[dict[str, Any]]:
        done = []
        for action, *args in script:
            record: dict[str, Any] = {"action": [action, *args]}
            began = time.monotonic()
            try:
                record["ok"] = getattr(self, f"do_{action}")(*args)
            except Exception as exc:  # recorded: the test says which failures it expects
                record["error"] = error_record(exc)
            record["seconds"] = round(time.monotonic() - began, 3)
            done.append(record)
            log(record)
        if not self.closed:
            try:
                self.manager.close()
            except Exception as exc:
                done.append({"action": ["close (at exit)"], "error": error_record(exc)})
        return done

    def do_save(self, step: int, tag: str) -> dict[str, Any]:
        fill(self.model, tag, step, self.rank, self.world)
        start = time.perf_counter()
        self.manager.save(step, self.state(tag, step))
        return {"blocked_s": time.perf_counter() - start}

    def do_wait(self) -> None:
        self.manager.wait()

    def do_load(self, tag: str) -> dict[str, Any]:
        fill(self.model, "fresh", 0, self.rank, self.world)  # other values than any save
        state = self.state("fresh", 0)
        resume = self.manager.load_latest(state)
        out: dict[str, Any] = {"step": resume.step, "url": resume.url}
        if resume.step is not None:
            out["differing"] = differing(self.model, tag, resume.step, self.rank, self.world)
            out["extra"] = resume.values.get("extra")
        return out

    def do_signal(self, name: str) -> None:
        with open(os.path.join(self.sync_dir, f"{name}-r{self.rank}"), "w"):
            pass

    def do_await(self, name: str) -> None:
        path = os.path.join(self.sync_dir, name)
        deadline = time.monotonic() + AWAIT_TIMEOUT_S
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear in {AWAIT_TIMEOUT_S} s")
            time.sleep(0.02)

    def do_break_uploader(self, rank: int) -> None:
        """On ``rank`` only: its uploader thread dies in the middle of the next upload (after
        the first collective, between two others), as a bug in it would."""
        if self.rank != rank:
            return
        uploader = self.manager.tier.uploader

        def broken(steps, tracker):
            raise RuntimeError(f"injected: the uploader of rank {rank} breaks")

        uploader.tier.delete = broken

    def do_kill(self) -> None:
        dist.barrier()
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def do_close(self) -> None:
        self.closed = True
        self.manager.close()

    def do_reopen(self, local_dir: str) -> None:
        if not self.closed:
            self.manager.close()
        self.manager = self.open(local_dir)
        self.closed = False


def scenario(rank: int, world: int, save_dir: dict[str, Any]) -> dict[str, Any]:
    """This start's script (``$ZEPHON_TIER_TEST``) on this rank, each action printed as it ends
    (a child that kills itself leaves its parent those lines)."""
    config = json.loads(os.environ["ZEPHON_TIER_TEST"])
    job = Job(rank, world, config, save_dir)
    return {
        "actions": job.run(
            config["script"], lambda record: print("ACTION " + json.dumps(record), flush=True)
        )
    }


if __name__ == "__main__":
    serve(scenario, timeout=TIMEOUT_S)
