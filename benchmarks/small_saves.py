"""Small-save benchmark: the fixed cost of a save of at most 1 MB, on local disk with a SQLite
catalog (issue 22, requirement 5: at most 30 ms above writing the same files).

    python benchmarks/small_saves.py [--repeats 15] [--kib 512] [--cases manager,dropin,hf]
    python benchmarks/small_saves.py --profile manager [--repeats 30]   # where the time goes

Cases, each in one process on one local disk, every Zephon save recorded in a SQLite catalog:

manager     ``zephon.CheckpointManager.save`` of a small MLP and its Adam state (``--kib`` KiB
            of tensors in all), through the one save path (``zephon.saving.Save``);
dropin      torch's ``dcp.save`` with ``zephon.dcp.Writer`` (one Writer for the job, a
            ``checkpoint_id`` per save), of the same tensors;
hf          the Hugging Face ``Trainer`` with ``ZephonCallback`` on a config-built tiny Llama
            (save_steps=1): the callback's ``on_save`` (the upload of ``checkpoint-N``) against
            the Trainer's own save of that folder;
accelerate  ``AcceleratorCheckpoints.save_state`` of a ~10 KB model + optimizer against
            accelerate's own ``save_state``.

For each, the baseline "plain write" writes the same files (the same names, bytes and count as
the save left on disk, the marker included) into a fresh directory the way Zephon makes them
durable: each file written and fsynced, then each directory fsynced. For hf and accelerate
the plain write is the framework's own save followed by that copy of its folder; for manager
and dropin torch's own ``dcp.save`` to a ``FileSystemWriter`` is shown beside it.

    fixed cost = median over the repeats of (Zephon's save - the plain write)

Times are medians over ``--repeats`` saves, the sides interleaved (each repeat runs every side
once, back to back), which keeps the load of a shared machine out of the comparison; CPU
milliseconds (``getrusage``, user + system) are shown beside wall time, since noise moves them
less. ``--profile CASE`` instead runs that case's Zephon saves under cProfile and prints where
the time goes, with the number of catalog transactions (SQLAlchemy commits) and fsyncs per save.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from _common import table

RUN = "small"


# -- measuring ------------------------------------------------------------------------------------


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Side:
    """One side of a comparison: its wall and CPU times, one per repeat."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.wall: list[float] = []
        self.cpu: list[float] = []

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        wall, cpu = time.perf_counter(), cpu_s()
        yield
        self.cpu.append(cpu_s() - cpu)
        self.wall.append(time.perf_counter() - wall)

    def run(self, fn: Callable[[], object]) -> None:
        with self.timing():
            fn()

    @property
    def ms(self) -> float:
        return statistics.median(self.wall) * 1000

    @property
    def cpu_ms(self) -> float:
        return statistics.median(self.cpu) * 1000


# -- the plain write ------------------------------------------------------------------------------


def snapshot(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, with its bytes."""
    files = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, folder)] = handle.read()
    return files


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_write(files: dict[str, bytes], dest: str) -> None:
    """Write ``files`` under ``dest`` as Zephon makes a save durable: each file written and
    fsynced, then every directory made (and ``dest``'s parent) fsynced."""
    dirs = {dest}
    for rel, data in files.items():
        path = os.path.join(dest, rel)
        parent = os.path.dirname(path)
        if parent not in dirs:
            os.makedirs(parent, exist_ok=True)
            while parent != dest:
                dirs.add(parent)
                parent = os.path.dirname(parent)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    for directory in sorted(dirs, key=len, reverse=True):
        fsync_dir(directory)
    fsync_dir(os.path.dirname(dest))


def copy_folder(folder: str, dest: str) -> None:
    """The plain write of a folder already on disk: read each file, then ``plain_write``."""
    plain_write(snapshot(folder), dest)


def save_folder(root: str, step: int) -> str:
    return os.path.join(root, "ckpt", RUN, f"save-{step}")


# -- the cases ------------------------------------------------------------------------------------


def mlp_state(kib: int):
    """A small MLP and its Adam state, ``kib`` KiB of tensors in all (weights + 2 moments)."""
    import torch
    from torch import nn

    width = 64
    layer_kib = (width * width + width) * 4 / 1024
    layers = max(1, round(kib / 3 / layer_kib))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def case_manager(root: str, kib: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    import zephon

    model, optimizer = mlp_state(kib)
    config = zephon.CheckpointingConfig(
        save_dir=f"{root}/ckpt",
        period_steps=1,
        num_to_keep=None,
        catalog_url=f"sqlite:///{root}/catalog.db",
    )
    manager = zephon.CheckpointManager(config, run_name=RUN, total_steps=100_000)
    manager.load_latest({"model": model, "optimizer": optimizer})

    def save(step: int) -> None:
        manager.save(step, {"model": model, "optimizer": optimizer})

    return save, manager.close


def case_dropin(root: str, kib: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    import torch.distributed.checkpoint as dcp

    from zephon import dcp as zd

    model, optimizer = mlp_state(kib)
    state = tensors_of(model, optimizer)
    run_url = f"{root}/ckpt/{RUN}"
    writer = zd.Writer(run_url, catalog=f"sqlite:///{root}/catalog.db")

    def save(step: int) -> None:
        dcp.save(state, storage_writer=writer, checkpoint_id=f"{run_url}/save-{step}")

    return save, writer.close


def tensors_of(model, optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def torch_dcp_save(kib: int) -> Callable[[str], None]:
    """torch's own ``dcp.save`` of the same tensors to a ``FileSystemWriter`` at a path."""
    import torch.distributed.checkpoint as dcp

    state = tensors_of(*mlp_state(kib))

    def save(path: str) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))

    return save


def run_dcp_case(name: str, repeats: int, kib: int, root: str) -> list[tuple]:
    """manager or dropin: Zephon's save, the plain write of its files, torch's dcp.save."""
    make = case_manager if name == "manager" else case_dropin
    save, close = make(root, kib)
    stock = torch_dcp_save(kib)
    zephon_side, plain_side, dcp_side = Side("zephon"), Side("plain"), Side("dcp")
    try:
        save(1)  # warm-up: imports, the attempt, the first catalog transactions
        files = snapshot(save_folder(root, 1))
        stock(f"{root}/dcp-warm")
        for step in range(2, repeats + 2):
            zephon_side.run(lambda step=step: save(step))
            plain_side.run(lambda step=step: plain_write(files, f"{root}/plain-{step}"))
            dcp_side.run(lambda step=step: stock(f"{root}/dcp-{step}"))
    finally:
        close()
    size = sum(len(data) for data in files.values())
    return [result_row(name, size, len(files), zephon_side, plain_side, dcp_side)]


def paired_ms(a: list[float], b: list[float]) -> float:
    """The median of the per-repeat differences ``a - b``, in ms (each pair measured back to
    back, so a load change between repeats cancels out)."""
    return statistics.median(x - y for x, y in zip(a, b, strict=True)) * 1000


def result_row(name, size, count, zephon_side: Side, plain: Side, own: Side) -> tuple:
    return (
        name,
        f"{size / 1024:.0f} KiB / {count}",
        f"{zephon_side.ms:.1f}",
        f"{plain.ms:.1f}",
        f"{own.ms:.1f}",
        f"{paired_ms(zephon_side.wall, plain.wall):.1f}",
        f"{paired_ms(zephon_side.cpu, plain.cpu):.1f}",
        f"{zephon_side.ms / plain.ms:.2f}",
        f"{zephon_side.ms / own.ms:.2f}",
    )


HEADERS = (
    "case",
    "size / files",
    "zephon ms",
    "plain ms",
    "own ms",
    "fixed ms",
    "fixed cpu ms",
    "zephon/plain",
    "zephon/own",
)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def run_hf(repeats: int, root: str) -> list[tuple]:
    """The Trainer saves every step; its own save (``_save_checkpoint``), the plain copy of the
    folder it wrote and ``ZephonCallback.on_save`` are timed at each save."""
    import torch
    from transformers import Trainer, TrainingArguments, set_seed
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    from zephon.integrations.huggingface import ZephonCallback

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 64, (4096, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    set_seed(0)
    args = TrainingArguments(
        output_dir=f"{root}/out",
        max_steps=repeats + 1,
        save_steps=1,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
    )
    callback = ZephonCallback(f"{root}/ckpt", RUN, catalog=f"sqlite:///{root}/catalog.db")
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.remove_callback(PrinterCallback)
    zephon_side, plain_side, own_side = Side("zephon"), Side("plain"), Side("own")
    sizes: list[tuple[int, int]] = []
    own_save = trainer._save_checkpoint

    def timed_own_save(*a, **k):
        if trainer.state.global_step == 1:  # warm-up
            return own_save(*a, **k)
        with own_side.timing():
            return own_save(*a, **k)

    trainer._save_checkpoint = timed_own_save
    on_save = callback.on_save

    def timed_on_save(args, state, control, **kwargs):
        step = state.global_step
        if step == 1:
            return on_save(args, state, control, **kwargs)
        folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        files = snapshot(folder)
        sizes.append((sum(len(d) for d in files.values()), len(files)))
        # the plain side: the Trainer's own save (timed above) + this copy of its folder
        with plain_side.timing():
            copy_folder(folder, f"{root}/plain-{step}")
        with zephon_side.timing():
            return on_save(args, state, control, **kwargs)

    callback.on_save = timed_on_save
    trainer.train()
    plain_side.wall = [c + o for c, o in zip(plain_side.wall, own_side.wall, strict=True)]
    plain_side.cpu = [c + o for c, o in zip(plain_side.cpu, own_side.cpu, strict=True)]
    # Zephon's side is the Trainer's own save followed by on_save, like the plain side
    zephon_side.wall = [z + o for z, o in zip(zephon_side.wall, own_side.wall, strict=True)]
    zephon_side.cpu = [z + o for z, o in zip(zephon_side.cpu, own_side.cpu, strict=True)]
    size, count = sizes[-1]
    return [result_row("hf", size, count, zephon_side, plain_side, own_side)]


def run_accelerate(repeats: int, root: str) -> list[tuple]:
    import torch
    from accelerate import Accelerator

    from zephon.integrations.accelerate import AcceleratorCheckpoints

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    checkpoints = AcceleratorCheckpoints(
        accelerator,
        f"{root}/ckpt",
        RUN,
        catalog=f"sqlite:///{root}/catalog.db",
        local_dir=f"{root}/staging",
    )
    checkpoints.load_state()
    zephon_side, plain_side, own_side = Side("zephon"), Side("plain"), Side("own")

    def plain(step: int) -> None:
        folder = f"{root}/own-plain-{step}"
        accelerator.save_state(output_dir=folder)
        copy_folder(folder, f"{root}/plain-{step}")

    try:
        checkpoints.save_state(1)  # warm-up
        accelerator.save_state(output_dir=f"{root}/own-warm")
        files = snapshot(save_folder(root, 1))
        for step in range(2, repeats + 2):
            zephon_side.run(lambda step=step: checkpoints.save_state(step))
            plain_side.run(lambda step=step: plain(step))
            own_side.run(lambda step=step: accelerator.save_state(output_dir=f"{root}/own-{step}"))
    finally:
        checkpoints.close()
    size = sum(len(data) for data in files.values())
    return [result_row("accelerate", size, len(files), zephon_side, plain_side, own_side)]


# -- profiling ------------------------------------------------------------------------------------


class Counts:
    """Catalog transactions (SQLAlchemy commits, any engine), SQL statements, fsyncs and
    threads started while counting."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        def on_commit(conn) -> None:
            self.counts["catalog transactions"] += 1

        def on_statement(conn, cursor, statement, parameters, context, executemany) -> None:
            self.counts["SQL statements (BEGIN and COMMIT included)"] += 1

        real_fsync, real_start = os.fsync, threading.Thread.start

        def fsync(fd) -> None:
            self.counts["fsyncs"] += 1
            real_fsync(fd)

        def start(thread) -> None:
            self.counts["threads started"] += 1
            real_start(thread)

        event.listen(Engine, "commit", on_commit)
        event.listen(Engine, "before_cursor_execute", on_statement)
        os.fsync, threading.Thread.start = fsync, start
        try:
            yield
        finally:
            os.fsync, threading.Thread.start = real_fsync, real_start
            event.remove(Engine, "before_cursor_execute", on_statement)
            event.remove(Engine, "commit", on_commit)


def profile(case: str, repeats: int, kib: int, root: str) -> None:
    if case in ("manager", "dropin"):
        save, close = (case_manager if case == "manager" else case_dropin)(root, kib)
    elif case == "accelerate":
        raise SystemExit("--profile supports manager and dropin")
    else:
        raise SystemExit(f"--profile {case!r}: use manager or dropin")
    counts = Counts()
    profiler = cProfile.Profile()
    try:
        save(1)
        with counts.counting():
            profiler.enable()
            started = time.perf_counter()
            for step in range(2, repeats + 2):
                save(step)
            elapsed = time.perf_counter() - started
            profiler.disable()
    finally:
        close()
    print(f"{case}: {elapsed / repeats * 1000:.1f} ms per save (under cProfile)")
    for what, n in sorted(counts.counts.items()):
        print(f"  {what} per save: {n / repeats:.1f}")
    if os.environ.get("SMALL_PROFILE_OUT"):
        profiler.dump_stats(os.environ["SMALL_PROFILE_OUT"])
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(60)
    print(out.getvalue())


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kib", type=int, default=512, help="tensor KiB of manager/dropin")
    parser.add_argument("--cases", default="manager,dropin,hf,accelerate")
    parser.add_argument("--profile", metavar="CASE", help="profile one case instead")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="zephon-small-")
    try:
        if args.profile:
            profile(args.profile, args.repeats, args.kib, root)
            return
        rows = []
        for case in args.cases.split(","):
            where = os.path.join(root, case)
            os.makedirs(where)
            if case in ("manager", "dropin"):
                rows += run_dcp_case(case, args.repeats, args.kib, where)
            elif case == "hf":
                rows += run_hf(args.repeats, where)
            elif case == "accelerate":
                rows += run_accelerate(args.repeats, where)
            else:
                raise SystemExit(f"unknown case {case!r}: use manager, dropin, hf, accelerate")
            shutil.rmtree(where, ignore_errors=True)
        print(
            f"medians of {args.repeats} interleaved saves; own = torch dcp.save (manager, "
            "dropin), the framework's own save (hf, accelerate)"
        )
        print(table(rows, HEADERS))
        if args.json:
            for row in rows:
                print("ROW " + json.dumps(dict(zip(HEADERS, row, strict=True))))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
