"""Shared helpers for the benchmark scripts: repo on sys.path, timing, the local servers, the
rank processes of the multi-process benchmarks, and DCP's side of a save/restore comparison.

Every benchmark reports ratios against a baseline measured in the same run, because the machine
is shared and absolute numbers drift from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests import servers  # noqa: E402  (needs the repo on sys.path)
from tests.ranks import join_group  # noqa: E402  (the same rank set-up as the tests')
from tests.s3_calls import S3Calls  # noqa: E402

__all__ = [
    "REPO",
    "servers",
    "timed",
    "best_of",
    "interleaved",
    "count_s3_requests",
    "table",
    "run_ranks",
    "parse_or_serve",
    "join_group",
    "Sides",
    "build_state",
    "empty_like_state",
    "tensors_of",
    "evict",
    "s3torch_environment",
    "s3torch_missing",
]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_of(repeats: int, fn: Callable[[], object], setup: Callable[[], object] = lambda: None):
    """Median and minimum wall time of ``fn`` over ``repeats`` runs, ``setup`` untimed."""
    times = []
    for _ in range(repeats):
        setup()
        times.append(timed(fn))
    return statistics.median(times), min(times)


def interleaved(
    repeats: int,
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    setup: Callable[[], object] = lambda: None,
) -> tuple[float, float, float]:
    """Median baseline time, median candidate time, and the median of the per-repeat ratios
    baseline/candidate, running the two back to back in each repeat so that load changes on a
    shared machine hit both alike."""
    base_times, cand_times, ratios = [], [], []
    for _ in range(repeats):
        setup()
        b = timed(baseline)
        setup()
        c = timed(candidate)
        base_times.append(b)
        cand_times.append(c)
        ratios.append(b / c)
    return statistics.median(base_times), statistics.median(cand_times), statistics.median(ratios)


class count_s3_requests(S3Calls):  # noqa: N801 - a context manager, reads like a function
    """Count the HTTP requests an s3fs filesystem sends while the block runs."""

    def __init__(self, fs) -> None:
        super().__init__(fs)
        self.count = 0
        self.by_operation: dict[str, int] = {}

    def on_call(self, model, params) -> None:
        self.count += 1
        self.by_operation[model.name] = self.by_operation.get(model.name, 0) + 1


def table(rows: list[tuple], headers: tuple) -> str:
    cells = [tuple(str(c) for c in headers)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def start_ranks(
    script: str, world: int, config: dict, *, flag: str = "--worker", stderr=None
) -> list[subprocess.Popen]:
    """Start ``script <flag> <rank> <world> <port> <config json>`` as ``world`` processes (a
    rendezvous port for torch.distributed on 127.0.0.1), their standard output piped as text
    (``stderr``: ``subprocess.STDOUT`` to merge it there)."""
    port = servers.free_port()
    env = {**os.environ, "PYTHONPATH": REPO}
    argv = [sys.executable, os.path.abspath(script), flag]
    return [
        subprocess.Popen(
            [*argv, str(rank), str(world), str(port), json.dumps(config)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        for rank in range(world)
    ]


def run_ranks(script: str, world: int, config: dict, what: str) -> dict:
    """Run ``script --worker <rank> <world> <port> <config json>`` as ``world`` processes
    (``start_ranks``) and return the JSON that rank 0 prints on a line ``RESULT <json>``.
    ``what`` names the case if a rank fails."""
    procs = start_ranks(script, world, config)
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        # what rank 0 measured before the failure (``PARTIAL`` lines) is kept
        partial = [x for x in outputs[0].splitlines() if x.startswith("PARTIAL ")]
        failed = f"{what} on {world} process(es): a rank exited with an error"
        raise SystemExit("\n".join([*partial, failed]))
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def parse_or_serve(
    parser: argparse.ArgumentParser, worker: Callable[[int, int, int, dict], None]
) -> argparse.Namespace | None:
    """The benchmark's arguments; or, in a process ``run_ranks`` started (``--worker RANK WORLD
    PORT CONFIG``, hidden from ``--help``), run ``worker(rank, world, port, config)`` and return
    None: the caller's ``main`` then has nothing left to do."""
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker:
        return args
    rank, world, port, config = args.worker
    worker(int(rank), int(world), int(port), json.loads(config))
    return None


def build_state(rank: int, per_rank_mib: float):
    """A model + Adam state (fp32 Linear layers: parameters, exp_avg, exp_avg_sq) of about
    ``per_rank_mib`` MiB under this rank's own key, as sharded training holds it."""
    import torch
    import torch.nn as nn

    width = 1024 if per_rank_mib >= 48 else 256
    layer_mib = (width * width + width) * 4 / (1 << 20)
    layers = max(1, round(per_rank_mib / 3 / layer_mib))
    torch.manual_seed(rank)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return {f"rank{rank}": {"model": model.state_dict(), "optim": optim.state_dict()}}


def empty_like_state(state):
    """A state of the same structure whose tensors are zeros: the destination of a load."""
    import torch

    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)  # zeros, so its pages exist before anything is timed
    return state


def tensors_of(state, out=None):
    """Every tensor of a nested state, in order."""
    import torch

    out = [] if out is None else out
    if isinstance(state, dict):
        for v in state.values():
            tensors_of(v, out)
    elif isinstance(state, list):
        for v in state:
            tensors_of(v, out)
    elif isinstance(state, torch.Tensor):
        out.append(state)
    return out


def evict(directory: str) -> None:
    """Drop a directory's (clean, fsynced) pages from the page cache: the next read is cold."""
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


#: s3torchconnector's client needs a region; moto's server takes any
S3T_REGION = "us-east-1"


def s3torch_environment(options: dict) -> None:
    """Point s3torchconnector at the S3 server of s3fs ``options`` (moto's): its DCP classes take
    no endpoint, but its native client reads ``AWS_ENDPOINT_URL`` and the usual credential
    variables when it is built. Call in a rank process before its first request."""
    os.environ["AWS_ENDPOINT_URL"] = options["client_kwargs"]["endpoint_url"]
    os.environ["AWS_ACCESS_KEY_ID"] = options["key"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = options["secret"]
    os.environ.setdefault("AWS_REGION", S3T_REGION)


def s3torch_missing() -> str | None:
    """Why s3torchconnector's DCP classes cannot be imported here, or None if they can."""
    try:
        import s3torchconnector.dcp  # noqa: F401
    except ImportError as e:
        return (
            f"s3torchconnector's DCP classes do not import ({e}): "
            "pip install -r benchmarks/requirements.txt"
        )
    return None


def _s3t_config():
    """Path-style requests (moto's server has no per-bucket host names)."""
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


class Sides:
    """One rank's sides of a save/restore comparison on one storage root: torch DCP's own
    writer and reader (``FileSystemWriter``/``Reader`` on local disk, ``FsspecWriter``/``Reader``
    elsewhere), each checkpoint in ``<url>/dcp-<name>``; on S3, AWS's s3torchconnector's
    ``S3StorageWriter``/``Reader`` in ``<url>/s3t-<name>``; and Zephon's ``ZephonStorageWriter``
    over ``store`` (rank 0 begins the save, every rank attaches). Call only in a rank process:
    it uses the default process group."""

    def __init__(self, store, rank: int, config: dict) -> None:
        self.store, self.rank = store, rank
        self.url, self.options = config["url"], config["storage_options"]
        self.local = config["local"]
        self.threads, self.dcp_threads = config["threads"], config["dcp_threads"]
        self.s3t_threads = config.get("s3t_threads") or self.threads

    def dcp_dir(self, name: str) -> str:
        return f"{self.url}/dcp-{name}"

    def dcp_writer(self, name: str):
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if self.local:
            return FileSystemWriter(self.dcp_dir(name), thread_count=self.dcp_threads)
        return FsspecWriter(self.dcp_dir(name), thread_count=self.dcp_threads, **self.options)

    def dcp_reader(self, name: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        path = self.dcp_dir(name)
        return FileSystemReader(path) if self.local else FsspecReader(path, **self.options)

    def s3t_dir(self, name: str) -> str:
        return f"{self.url}/s3t-{name}"

    def s3t_writer(self, name: str):
        """AWS's s3torchconnector DCP writer (S3 only; ``s3torch_environment`` first)."""
        from s3torchconnector.dcp import S3StorageWriter

        return S3StorageWriter(
            S3T_REGION,
            self.s3t_dir(name),
            s3client_config=_s3t_config(),
            thread_count=self.s3t_threads,
        )

    def s3t_reader(self, name: str):
        """AWS's s3torchconnector DCP reader, with its default (DCP-optimised) range reads."""
        from s3torchconnector.dcp import S3StorageReader

        return S3StorageReader(S3T_REGION, self.s3t_dir(name), s3client_config=_s3t_config())

    def zephon_writer(self, run: str, step: int, fence=None):
        from zephon import dcp as zd

        primary = self.store.run(run).begin(step, fence=fence) if self.rank == 0 else None
        writer = zd.attach_ranks(self.store, run, step, primary)
        return zd.ZephonStorageWriter(writer, thread_count=self.threads)

    def remove(
        self, run: str, steps: list[int], dcp_names: list[str], s3t_names: list[str] = ()
    ) -> None:
        """Delete what a phase wrote (Zephon's ``steps`` of ``run``, DCP's and s3torchconnector's
        checkpoints), every rank past it before and after: moto keeps it all in memory, a disk
        fills up."""
        import torch.distributed as dist

        dist.barrier()
        if self.rank == 0:
            for step in steps:
                self.store.run(run).delete(step)
            for name in dcp_names:
                if self.local:
                    shutil.rmtree(self.dcp_dir(name), ignore_errors=True)
                else:
                    self.store.location.fs.rm(self.dcp_dir(name), recursive=True)
            for name in s3t_names:
                self.store.location.fs.rm(self.s3t_dir(name), recursive=True)
        dist.barrier()
