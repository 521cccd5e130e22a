"""One process of the resharding tests: ``python -m tests.zephon.dcp.reshard_worker RANK 4 PORT``.

The storage root comes from ``tests.ranks.launch``'s configuration (``url`` and
``storage_options``, ``tests.ranks.store_config``). The four processes are started once and
go through every layout in turn, each phase a process group of its own over one TCP store (a
``PrefixStore`` per phase), so no layout pays for starting processes and importing torch again:

  start  rank 0 alone saves the same state as plain tensors (``manager1/reshard``), for 1 -> 2
  save   4 ranks, ``Shard(0)`` DTensors (10 and 6 rows over 4 ranks: uneven, one shard empty),
         AdamW after one step: a manager checkpoint (``manager/reshard``) with per-rank
         non-tensor state, the same state through torch's ``dcp.save`` with
         ``zephon.dcp.Writer`` (``dcp/reshard``), and a copy (``dcp/damaged``) in which rank 0
         flips one byte of one saved chunk; then docs/manager.md's example saves on 4 ranks
  two    ranks 0 and 1: each layout (``Shard(0)``, ``Replicate()``, ``Shard(1)``) loaded through
         the manager, through ``dcp.load`` with ``zephon.dcp.Reader``, and the manager's
         checkpoint through the plain Reader (``subdir="dcp"``); the damaged copy loaded as
         ``Shard(0)`` with and without verification; the one-process checkpoint loaded as
         ``Shard(1)`` (1 -> 2); a manager checkpoint saved on these 2 ranks
         (``manager2/reshard``); the docs example loads on 2 ranks
  four   4 ranks again: the 2-rank checkpoint (2 -> 4) and the 4-rank one (4 -> 4: the control)
  one    rank 0 alone, without torch.distributed: every checkpoint as plain tensors

Each process prints one line ``RESULT <json>`` of what it saw; the test asserts on those.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    init_device_mesh,
)

from tests.ranks import rank_config
from tests.servers import free_port
from tests.zephon.dcp.worker import error_record
from zephon import CheckpointingConfig, CheckpointManager
from zephon import dcp as zd

RUN = "reshard"
WORLD = 4
#: the torch RNG seed every rank sets before a load: a load that restores no RNG leaves it so
LOAD_SEED = 4242
#: the learning rate saved; loads start from another, so param_groups show whether they loaded
SAVED_LR = 0.1
TIMEOUT = dt.timedelta(seconds=120)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DOCS = os.path.join(ROOT, "docs", "manager.md")
SECTION = "## Changing the world size (resharding)"


def docs_example() -> str:
    """The example program of docs/manager.md's section on changing the world size."""
    with open(DOCS) as handle:
        text = handle.read()
    section = text[text.index(SECTION) :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"{DOCS}: no python block under {SECTION!r}"
    return match.group(1)


# -- the model and its state ----------------------------------------------------------------


def placements_for(layout: str, ndim: int) -> list[Placement]:
    """A layout's placement of a tensor of ``ndim`` dimensions; ``shard1`` cuts matrices by
    column and vectors (which have no second dimension) by row."""
    if layout == "replicate":
        return [Replicate()]
    if layout == "shard1" and ndim >= 2:
        return [Shard(1)]
    return [Shard(0)]


def build(
    seed: int, layout: str | None, steps: int = 1, lr: float = SAVED_LR
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two linear layers (weights 10x12 and 6x10: uneven over 4 ranks, even over 2 by column)
    as DTensors laid out by ``layout`` on a mesh of every rank (plain tensors for None), and
    AdamW after ``steps`` steps with gradients drawn from ``seed``, so exp_avg and exp_avg_sq
    exist."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 10), nn.Linear(10, 6))
    grads = [torch.randn_like(p) for p in model.parameters()]
    if layout is not None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))

        def partition(name: str, module: nn.Module, mesh) -> None:
            for key, param in list(module.named_parameters(recurse=False)):
                placed = distribute_tensor(param.data, mesh, placements_for(layout, param.ndim))
                module.register_parameter(key, nn.Parameter(placed))

        distribute_module(model, mesh, partition)
        grads = [
            distribute_tensor(g, p.device_mesh, p.placements)
            for g, p in zip(grads, model.parameters(), strict=True)
        ]
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for _ in range(steps):
        for param, grad in zip(model.parameters(), grads, strict=True):
            param.grad = grad
        optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor)."""
    return value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()


def values_of(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, whole, by name (a collective)."""
    model_sd, optim_sd = get_state_dict(model, optim)
    out = {f"model.{k}": full(v) for k, v in model_sd.items()}
    for fqn, per_param in optim_sd["state"].items():
        for name, value in per_param.items():
            out[f"optim.{fqn}.{name}"] = full(value)
    return out


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    keys = a.keys() | b.keys()
    return sorted(k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k]))


def layout_of(model: nn.Module) -> dict[str, Any]:
    """Each parameter's placements and this rank's local shape."""
    return {
        name: [str(list(p.placements)), list(p.to_local().shape)]
        if isinstance(p, DTensor)
        else ["plain", list(p.shape)]
        for name, p in model.named_parameters()
    }


class Counter:
    """A stateful entry whose state differs per rank (like a per-rank data position)."""

    def __init__(self, rank: int | None = None) -> None:
        self.state: dict[str, Any] = {} if rank is None else {"rank": rank, "seen": 100 + rank}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


# -- the ways in and out ----------------------------------------------------------------------


def manager_state(model, optim, counter: Counter, rank: int) -> dict[str, Any]:
    extra = {"rank": rank, "vector": torch.full((3,), float(rank))}
    return {"model": model, "optimizer": optim, "counter": counter, "extra": extra}


def open_manager(root: str, options: dict, name: str) -> CheckpointManager:
    config = CheckpointingConfig(save_dir=f"{root}/{name}", storage_options=options)
    return CheckpointManager(config, run_name=RUN, total_steps=100)


def save_with_manager(root: str, options: dict, name: str, model, optim, rank: int) -> list:
    """Save step 1 with per-rank non-tensor state; returns the torch RNG's next draws as they
    were saved (what a load that restores this rank's RNG makes them be)."""
    torch.manual_seed(1000 + rank)
    with open_manager(root, options, name) as manager:
        state = manager_state(model, optim, Counter(rank), rank)
        manager.save(1, state, rank_state={"rank": rank, "name": f"rank-{rank}"})
    return torch.rand(2).tolist()


def load_with_manager(root: str, options: dict, name: str, model, optim) -> dict[str, Any]:
    """Load the latest checkpoint of ``name`` into ``model``/``optim``: what this rank got."""
    counter = Counter()
    torch.manual_seed(LOAD_SEED)
    with open_manager(root, options, name) as manager:
        resume = manager.load_latest(manager_state(model, optim, counter, -1))
    draws = torch.rand(2).tolist()
    torch.manual_seed(LOAD_SEED)
    extra = resume.values["extra"]
    return {
        "step": resume.step,
        "counter": counter.state,
        "extra": [extra["rank"], extra["vector"].tolist()],
        "rank_state": resume.rank_state,
        "rng_draws": draws,
        "rng_untouched": draws == torch.rand(2).tolist(),
    }


def dcp_save(url: str, options: dict, model, optim) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    writer = zd.Writer(url, step=1, storage_options=options)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
    finally:
        writer.close()


def dcp_save_deduplicated(url: str, options: dict, model, optim) -> None:
    """The same state saved twice with ``dedup=True`` (docs/dedup.md): the second save's
    shards are all chunks the first uploaded, which the loads of the latest then read."""
    model_sd, optim_sd = get_state_dict(model, optim)
    writer = zd.Writer(url, storage_options=options, dedup=True)
    try:
        for step in (1, 2):
            dcp.save(
                {"model": model_sd, "optim": optim_sd},
                storage_writer=writer,
                checkpoint_id=f"{url}/save-{step}",
            )
    finally:
        writer.close()


def dcp_load(url: str, options: dict, model, optim, *, verify: bool = True) -> None:
    """torch's own recipe: the state dicts of the new layout, ``dcp.load`` into them, set."""
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    with zd.Reader(url, storage_options=options, verify=verify) as reader:
        dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def manager_checkpoint_via_reader(url: str, options: dict, model, optim) -> None:
    """A manager checkpoint read with the plain Reader, as docs/manager.md says: tensors under
    ``subdir="dcp"``, keyed ``model/<fqn>`` and ``optimizer/state/<fqn>/<name>``."""
    model_sd, optim_sd = get_state_dict(model, optim)
    flat = {f"model/{k}": v for k, v in model_sd.items()}
    for fqn, per_param in optim_sd["state"].items():
        for name, value in per_param.items():
            flat[f"optimizer/state/{fqn}/{name}"] = value
    with zd.Reader(url, storage_options=options, subdir="dcp") as reader:
        dcp.load(flat, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)


def damage_one_chunk(url: str, options: dict) -> dict[str, Any]:
    """Flip one byte of the chunk of ``model.0.weight`` rank 1 saved (rows 3..5), in row 5.
    Loaded as Shard(0) over 2 ranks, rank 0 needs rows 3..4 of that chunk, rank 1 row 5."""
    with zd.Reader(url, storage_options=options) as reader:
        metadata = reader.read_metadata()
        where = next(
            s
            for index, s in metadata.storage_data.items()
            if index.fqn == "model.0.weight" and list(index.offset) == [3, 0]
        )
        path = reader.store.run(reader.run).reader(reader.step).path
        fs = reader.store.location.fs
        data = bytearray(fs.cat_file(f"{path}/{where.file}"))
        data[where.offset + (2 * 12 + 5) * 4] ^= 0x40  # row 2 of the chunk, column 5, float32
        fs.pipe_file(f"{path}/{where.file}", bytes(data))
    return {"file": where.file, "shape": list(where.shape or [])}


def run_docs_example(store: dist.Store, phase: str, rank: int, world: int, mode: str, root: str):
    """docs/manager.md's example as ``torchrun`` would run it: its own env:// rendezvous."""
    key = f"{phase}-port"
    if rank == 0:
        store.set(key, str(free_port()))
    port = store.get(key).decode()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank)}
    os.environ.update(env, WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    argv, sys.argv = sys.argv, ["reshard.py", mode, f"{root}/docs"]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(docs_example(), "reshard.py", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = argv
    return printed.getvalue()


# -- the phases -----------------------------------------------------------------------------


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"ok": fn()}``, or ``{"error": ...}`` with the error Zephon makes of DCP's
    ``CheckpointException`` (the lowest failing rank's, noted with that rank)."""
    try:
        return {"ok": fn()}
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one
        if not isinstance(exc, Exception | CheckpointException):
            raise
        translated = zd.as_zephon_error(exc, where="the load")
        record = error_record(translated)
        record.update(raw=type(exc).__name__, notes=getattr(translated, "__notes__", []))
        return {"error": record}


def phase_save(rank: int, root: str, options: dict, out: dict) -> dict[str, torch.Tensor]:
    model, optim = build(seed=1, layout="shard0")
    expected = values_of(model, optim)
    out["saved_layout"] = layout_of(model)
    out["saved_rng_draws"] = save_with_manager(root, options, "manager", model, optim, rank)
    dcp_save(f"{root}/dcp/{RUN}", options, model, optim)
    dcp_save(f"{root}/dcp/damaged", options, model, optim)
    dcp_save_deduplicated(f"{root}/dedup/{RUN}", options, model, optim)
    dist.barrier()
    if rank == 0:
        out["damaged"] = damage_one_chunk(f"{root}/dcp/damaged", options)
    dist.barrier()
    return expected


def load_every_way(
    root: str, options: dict, expected: dict, layout: str | None, ways: dict[str, Callable]
) -> dict[str, Any]:
    loads = {}
    for way, load in ways.items():
        model, optim = build(seed=2, layout=layout, steps=2, lr=0.5)
        before = differences(values_of(model, optim), expected)
        got = attempt(lambda load=load, model=model, optim=optim: load(model, optim))
        loads[way] = {
            **got,
            "differed_before": before,
            "differ_after": differences(values_of(model, optim), expected),
            "layout": layout_of(model),
            "lr": optim.param_groups[0]["lr"],
        }
    return loads


def phase_two(rank: int, root: str, options: dict, expected: dict, out: dict) -> None:
    ways: dict[str, Callable] = {
        "manager": lambda m, o: load_with_manager(root, options, "manager", m, o),
        "dcp": lambda m, o: dcp_load(f"{root}/dcp/{RUN}", options, m, o),
        "dcp_dedup": lambda m, o: dcp_load(f"{root}/dedup/{RUN}", options, m, o),
        "manager_via_reader": lambda m, o: manager_checkpoint_via_reader(
            f"{root}/manager/{RUN}", options, m, o
        ),
    }
    out["two"] = {
        layout: load_every_way(root, options, expected, layout, ways)
        for layout in ("shard0", "replicate", "shard1")
    }
    out["two_from_one"] = load_every_way(
        root,
        options,
        expected,
        "shard1",
        {"manager": lambda m, o: load_with_manager(root, options, "manager1", m, o)},
    )["manager"]
    out["two_damaged"] = load_every_way(
        root,
        options,
        expected,
        "shard0",
        {
            f"verify_{verify}": lambda m, o, verify=verify: dcp_load(
                f"{root}/dcp/damaged", options, m, o, verify=verify
            )
            for verify in (True, False)
        },
    )
    # A checkpoint of this world size (loaded as Shard(1) from the 4-rank one), for 2 -> 4.
    model, optim = build(seed=2, layout="shard1")
    load_with_manager(root, options, "manager", model, optim)
    out["two_saved_rng_draws"] = save_with_manager(root, options, "manager2", model, optim, rank)


def phase_four(root: str, options: dict, expected: dict, out: dict) -> None:
    out["four"] = {
        name: load_every_way(
            root,
            options,
            expected,
            "shard0",
            {"manager": lambda m, o, n=name: load_with_manager(root, options, n, m, o)},
        )["manager"]
        for name in ("manager2", "manager")  # 2 -> 4, then 4 -> 4
    }


def phase_one(root: str, options: dict, expected: dict, out: dict) -> None:
    ways: dict[str, Callable] = {
        "manager": lambda m, o: load_with_manager(root, options, "manager", m, o),
        "manager2": lambda m, o: load_with_manager(root, options, "manager2", m, o),
        "dcp": lambda m, o: dcp_load(f"{root}/dcp/{RUN}", options, m, o),
        "dcp_dedup": lambda m, o: dcp_load(f"{root}/dedup/{RUN}", options, m, o),
        "manager_via_reader": lambda m, o: manager_checkpoint_via_reader(
            f"{root}/manager/{RUN}", options, m, o
        ),
    }
    out["one"] = load_every_way(root, options, expected, None, ways)


def join(store: dist.Store, phase: str, rank: int, world: int) -> None:
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(phase, store), rank=rank, world_size=world, timeout=TIMEOUT
    )


def main(rank: int, world: int, port: int) -> None:
    started = time.monotonic()
    assert world == WORLD, f"the resharding worker runs as {WORLD} processes"
    config = rank_config()
    root, options = config["url"], config["storage_options"]
    # Storage only: the runs of one name under several save_dirs would clash in one catalog.
    os.environ.pop("ZEPHON_CATALOG_URL", None)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": rank}
    seconds = out["seconds"] = {}

    def done(phase: str) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        seconds[phase] = round(time.monotonic() - started, 2)

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=TIMEOUT)
    try:
        if rank == 0:  # before any process group: the same state saved by one process
            model, optim = build(seed=1, layout=None)
            plain = values_of(model, optim)
            save_with_manager(root, options, "manager1", model, optim, rank)
            done("one_save")
        join(store, "save", rank, world)
        expected = phase_save(rank, root, options, out)
        if rank == 0:
            out["plain_differs_from_sharded"] = differences(plain, expected)
        done("save")
        # The example saves to a local directory, as printed; on another backend it is not run.
        local = "://" not in root
        if local:
            out["docs_save"] = run_docs_example(store, "docs-save", rank, world, "save", root)
            done("docs_save")
        if rank < 2:
            join(store, "two", rank, 2)
            phase_two(rank, root, options, expected, out)
            done("two")
            if local:
                out["docs_load"] = run_docs_example(store, "docs-load", rank, 2, "load", root)
                done("docs_load")
        join(store, "four", rank, world)
        phase_four(root, options, expected, out)
        done("four")
        if rank == 0:
            phase_one(root, options, expected, out)
            done("one")
        out["expected_keys"] = sorted(expected)
    except BaseException:
        out["crash"] = traceback.format_exc()
    finally:
        print("RESULT " + json.dumps(out, default=str), flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
