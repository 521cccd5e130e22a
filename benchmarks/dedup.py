"""Incremental checkpoints (``dedup``, docs/dedup.md): bytes stored and save time, in one run.

    python benchmarks/dedup.py [--base-mib 256] [--adapter-mib 4] [--saves 10]
                               [--full-mib 256] [--repeats 3] [--delay-ms 0]

moto's S3 server on 127.0.0.1 (behind ``latency_proxy.LatencyProxy`` adding ``--delay-ms`` to
every request when it is above 0), one process, ``zephon.dcp.Writer`` into a run of its own per
case, torch's ``dcp.save``:

(a) fine-tuning: a frozen ``--base-mib`` MiB base (8 tensors) and a trained ``--adapter-mib``
    MiB adapter with its Adam state (exp_avg, exp_avg_sq: three times the adapter's bytes
    change per save), ``--saves`` saves with ``dedup=True``. Goals: bytes on storage <= 1.1 x
    (base + saves x changed bytes); each save after the first <= 0.15 x the first save's time.
(b) pretraining: every byte changes (``--full-mib`` MiB of fresh values per save), dedup on and
    off interleaved, ``--repeats`` saves each. Goal: dedup's time and bytes <= 1.05 x.

The load average is printed with the ratios (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

from _common import servers, table, timed
from latency_proxy import LatencyProxy

MIB = 1 << 20
BUCKET = "dedup-bench"


def stored(fs, run_url: str) -> int:
    return sum(info["size"] for info in fs.find(run_url, detail=True).values())


def fine_tuning(url: str, options: dict, args) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from zephon import dcp as zd

    torch.manual_seed(0)
    per = args.base_mib * MIB // 4 // 8
    base = {f"base.{i}": torch.randn(per) for i in range(8)}
    adapter = torch.nn.Parameter(torch.randn(args.adapter_mib * MIB // 4))
    optimizer = torch.optim.Adam([adapter], lr=1e-3)
    writer = zd.Writer(url, dedup=True, storage_options=options)
    times = []
    for step in range(1, args.saves + 1):
        optimizer.zero_grad()
        (adapter * adapter).sum().backward()
        optimizer.step()
        adam = optimizer.state[adapter]
        state = {
            **base,
            "adapter": adapter.detach(),
            "exp_avg": adam["exp_avg"],
            "exp_avg_sq": adam["exp_avg_sq"],
        }
        times.append(
            timed(
                lambda s=state, n=step: dcp.save(
                    s, storage_writer=writer, checkpoint_id=f"{url}/save-{n}"
                )
            )
        )
    writer.close()
    return {"times": times, "changed": 3 * args.adapter_mib * MIB, "base": args.base_mib * MIB}


def pretraining(url: str, mib: int, step: int, writer) -> float:
    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"w.{i}": torch.randn(mib * MIB // 4 // 8) for i in range(8)}
    return timed(lambda: dcp.save(state, storage_writer=writer, checkpoint_id=f"{url}/save-{step}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-mib", type=int, default=256)
    parser.add_argument("--adapter-mib", type=int, default=4)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--full-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import s3fs
    import torch

    from zephon import dcp as zd

    torch.set_num_threads(1)
    loads = [os.getloadavg()[0]]
    with servers.s3_server() as s3, LatencyProxy(s3.endpoint_url, args.delay_ms) as proxy:
        s3.create_bucket(BUCKET)
        endpoint = proxy.url if args.delay_ms > 0 else s3.endpoint_url
        options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint},
        }
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)

        tuned = fine_tuning(f"s3://{BUCKET}/ckpt/tune", options, args)
        tuned_bytes = stored(fs, f"{BUCKET}/ckpt/tune")
        bound = tuned["base"] + args.saves * tuned["changed"]
        first, rest = tuned["times"][0], tuned["times"][1:]
        loads.append(os.getloadavg()[0])

        writers = {
            flag: zd.Writer(f"s3://{BUCKET}/ckpt/full-{flag}", dedup=flag, storage_options=options)
            for flag in (False, True)
        }
        full: dict[bool, list[float]] = {False: [], True: []}
        for step in range(1, args.repeats + 1):
            for flag in (False, True) if step % 2 else (True, False):
                full[flag].append(
                    pretraining(
                        f"s3://{BUCKET}/ckpt/full-{flag}", args.full_mib, step, writers[flag]
                    )
                )
        for writer in writers.values():
            writer.close()
        full_bytes = {flag: stored(fs, f"{BUCKET}/ckpt/full-{flag}") for flag in (False, True)}
        loads.append(os.getloadavg()[0])

    later = statistics.median(rest) if rest else float("nan")
    ratio_time = statistics.median(full[True]) / statistics.median(full[False])
    ratio_bytes = full_bytes[True] / full_bytes[False]
    rows = [
        (
            "fine-tuning: bytes on storage / (base + saves x changed)",
            f"{tuned_bytes / MIB:.1f} / {bound / MIB:.1f} MiB",
            f"{tuned_bytes / bound:.3f}",
            "<= 1.1",
        ),
        (
            "fine-tuning: a later save / the first (median)",
            f"{later:.3f} / {first:.3f} s",
            f"{later / first:.3f}",
            "<= 0.15",
        ),
        (
            "pretraining: dedup / plain save time (median)",
            f"{statistics.median(full[True]):.3f} / {statistics.median(full[False]):.3f} s",
            f"{ratio_time:.3f}",
            "<= 1.05",
        ),
        (
            "pretraining: dedup / plain bytes",
            f"{full_bytes[True] / MIB:.1f} / {full_bytes[False] / MIB:.1f} MiB",
            f"{ratio_bytes:.3f}",
            "<= 1.05",
        ),
    ]
    print(table(rows, ("measure", "figures", "ratio", "goal")))
    print(
        f"later saves: {', '.join(f'{t:.3f}' for t in rest)} s; pretraining plain "
        f"{', '.join(f'{t:.2f}' for t in full[False])} s, dedup "
        f"{', '.join(f'{t:.2f}' for t in full[True])} s"
    )
    print(f"load average (1 min) during the run: {', '.join(f'{x:.2f}' for x in loads)}")


if __name__ == "__main__":
    main()
