"""One rank of the multi-process DCP tests: ``python -m tests.zephon.dcp.worker RANK WORLD PORT``,
started by ``tests.ranks.launch`` with the storage root as its configuration (``url``,
``storage_options``). Every rank runs the same scenarios against one store, records what it saw,
and prints one line ``RESULT <json>``; the test process asserts on those records and inspects the
storage itself.

Scenarios (checkpoint steps):
  1  model + Adam state (replicated keys) + rank-unique tensors + a Shard(0) DTensor: save,
     then load into fresh modules, a fresh DTensor laid out as Shard(1), and mismatching dicts
  2  the last rank fails inside write_data: the save fails everywhere, step 2 stays uncommitted
  3  async saves (DCP's default stager, then twice ZephonStager), parameters changed in place
     right after each returns (also steps 6 and 7)
  4  async save whose last rank fails: the future fails on every rank
  5  saved, then rank 0 truncates a shard of the last rank: loads are refused naming the file
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from tests.ranks import serve
from zephon import dcp as zd
from zephon.storage import CheckpointStore

RUN = "dcp-test"


def build(seed: int, hidden: int = 32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 32), nn.LayerNorm(32), nn.Linear(32, 8)
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 16)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def rank_tensors(rank: int, fill: float | None = None) -> dict[str, torch.Tensor]:
    """Different per rank in key, shape, dtype and content."""
    torch.manual_seed(100 + rank)
    values = {
        "weights": torch.randn(rank + 2, 3),
        "counts": torch.arange(rank * 5, rank * 5 + 7, dtype=torch.int64),
        "half": torch.randn(5, rank + 1).to(torch.bfloat16),
    }
    if fill is not None:
        values = {k: torch.full_like(v, fill) for k, v in values.items()}
    return values


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        elif isinstance(value, list):
            out.update(flat(dict(enumerate(value)), f"{name}."))
        elif isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            out[name] = value
    return out


def same(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ bit for bit (or are missing on one side)."""
    fa, fb = flat(a), flat(b)
    bad = sorted(set(fa) ^ set(fb))
    for key in set(fa) & set(fb):
        x, y = fa[key], fb[key]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(-1), y.view(-1)):
            bad.append(key)
    return bad


def error_record(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": str(exc),
        "path": getattr(exc, "path", None),
    }


class FailingOpen:
    """Wraps a CheckpointWriter's ``open`` so every file it opens fails after 10 bytes, as a
    full disk under the backend does."""

    def __init__(self, writer) -> None:
        self.real_open = writer.open

    def __call__(self, name: str):
        real = self.real_open(name)

        class Broken:
            def __enter__(inner):
                handle = real.__enter__()
                real_write = handle.write

                def write(data, crc=None, *, in_place=False):
                    real_write(bytes(memoryview(data).cast("B")[:10]))
                    # the disk fills beneath the backend, which translates what it raises
                    target = handle._handle  # the backend's write handle (Backend.open_write)
                    with target._backend._doing("writing", target.path, creating=True):
                        raise OSError(28, "simulated: no space left on device")

                handle.write = write
                return handle

            def __exit__(inner, *exc):
                return real.__exit__(*exc)

        return Broken()


def writer_for(store: CheckpointStore, step: int, rank: int, **kwargs) -> zd.ZephonStorageWriter:
    primary = store.run(RUN).begin(step) if rank == 0 else None
    return zd.ZephonStorageWriter(zd.attach_ranks(store, RUN, step, primary), **kwargs)


def state_of(model, optim, rank: int, extra: dict | None = None) -> dict:
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        f"rank{rank}": extra if extra is not None else rank_tensors(rank),
    }


def scenarios(rank: int, world: int, config: dict) -> dict:
    """Every scenario on this rank, against the store ``config`` names."""
    with CheckpointStore(config["url"], config["storage_options"]) as store:
        return run_scenarios(store, rank, world)


def run_scenarios(store: CheckpointStore, rank: int, world: int) -> dict:
    last = world - 1
    out: dict = {}
    # -- 1: round trip -----------------------------------------------------------------
    model, optim = build(seed=1)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(7)
    full = torch.randn(world * 2, world * 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    state = state_of(model, optim, rank)
    state["sharded"] = sharded
    commits = []
    writer = writer_for(store, 1, rank, on_commit=commits.append, commit_metadata={"k": 1})
    zd.save(state, writer)
    out["committed_here"] = [m.file_count for m in commits]
    out["commit_metadata"] = commits[0].metadata if commits else None

    fresh_model, fresh_optim = build(seed=2)
    target = state_of(fresh_model, fresh_optim, rank, rank_tensors(rank, fill=-1.0))
    target["sharded"] = distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)])
    before = same(state, target)
    zd.load(target, zd.ZephonStorageReader(store, RUN, 1, verify=True))
    fresh_model.load_state_dict(target["model"])
    fresh_optim.load_state_dict(target["optim"])
    loaded = state_of(fresh_model, fresh_optim, rank, target[f"rank{rank}"])
    original = state_of(model, optim, rank)
    out["differed_before_load"] = len(before)
    out["differ_after_load"] = same(original, loaded)
    out["param_groups_equal"] = (
        fresh_optim.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    )
    assert isinstance(target["sharded"], DTensor)
    out["dtensor_resharded_equal"] = torch.equal(target["sharded"].full_tensor(), full)

    wrong_model, wrong_optim = build(seed=3, hidden=33)
    try:
        zd.load({"model": wrong_model.state_dict()}, zd.ZephonStorageReader(store, RUN, 1))
        out["wrong_shape"] = None
    except Exception as exc:
        out["wrong_shape"] = error_record(exc)
        out["wrong_shape"]["missing"] = exc.missing
        out["wrong_shape"]["shapes"] = sorted(exc.shape_mismatches)
    extra = {"model": fresh_model.state_dict(), "not_saved": {"w": torch.zeros(2)}}
    try:
        zd.load(extra, zd.ZephonStorageReader(store, RUN, 1))
        out["missing_key"] = None
    except Exception as exc:
        out["missing_key"] = error_record(exc)

    # -- 2: a rank fails inside write_data -------------------------------------------
    writer = writer_for(store, 2, rank)
    if rank == last:
        writer.writer.open = FailingOpen(writer.writer)
    try:
        zd.save(state_of(model, optim, rank), writer)
        out["failed_save"] = None
    except Exception as exc:
        out["failed_save"] = error_record(exc)
    dist.barrier()
    out["step2_committed"] = store.run(RUN).is_committed(2)
    try:
        zd.load(state_of(*build(seed=2), rank), zd.ZephonStorageReader(store, RUN, 2))
        out["uncommitted_load"] = None
    except Exception as exc:
        out["uncommitted_load"] = error_record(exc)

    # -- 3: async save copies on staging (default stager, then Zephon's reused buffers) ---
    group = dist.new_group(backend="gloo")
    stager = zd.ZephonStager()
    results = []
    for step, use_stager in ((3, False), (6, True), (7, True)):
        live = state_of(model, optim, rank)
        live["sharded"] = sharded
        snapshot = {k: v.clone() for k, v in flat(live).items()}
        sharded_before = sharded.full_tensor()
        future = zd.async_save(
            live,
            writer_for(store, step, rank),
            process_group=group,
            stager=stager if use_stager else None,
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1000.0)
            for per_param in optim.state.values():
                per_param["exp_avg"].mul_(-1.0)
            sharded.to_local().add_(1.0)
        future.result(timeout=120)
        dist.barrier()
        m3, o3 = build(seed=4)
        target = state_of(m3, o3, rank)
        target["sharded"] = distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)])
        zd.load(target, zd.ZephonStorageReader(store, RUN, step))
        changed = flat(state_of(model, optim, rank))
        results.append(
            same(snapshot, flat(target)) == []
            and same(changed, flat(target)) != []
            and torch.equal(target["sharded"].full_tensor(), sharded_before)
        )
    stager.close()
    out["async_copies_on_staging"] = results

    # -- 4: async save whose last rank fails -------------------------------------------
    writer = writer_for(store, 4, rank)
    if rank == last:
        writer.writer.open = FailingOpen(writer.writer)
    future = zd.async_save(state_of(model, optim, rank), writer, process_group=group)
    try:
        future.result(timeout=120)
        out["failed_async"] = None
    except Exception as exc:
        out["failed_async"] = error_record(exc)
    dist.barrier()
    out["step4_committed"] = store.run(RUN).is_committed(4)

    # -- 5: a truncated shard is refused, naming the file -------------------------------
    zd.save(state_of(model, optim, rank), writer_for(store, 5, rank))
    victim = f"__{last}_0.distcp"
    if rank == 0:
        manifest = store.run(RUN).read_manifest(5)
        entry = manifest.file(victim)
        path = f"{store.run(RUN).reader(5).path}/{victim}"
        data = store.location.fs.cat_file(path)
        store.location.fs.pipe_file(path, data[: entry.size // 2])
    dist.barrier()
    for verify in (True, False):
        try:
            zd.load(
                state_of(*build(seed=2), rank),
                zd.ZephonStorageReader(store, RUN, 5, verify=verify),
            )
            out[f"corrupt_verify_{verify}"] = None
        except Exception as exc:
            out[f"corrupt_verify_{verify}"] = error_record(exc)
    out["victim"] = victim
    dist.barrier()
    return out


if __name__ == "__main__":
    serve(scenarios)
