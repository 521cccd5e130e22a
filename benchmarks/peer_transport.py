"""The memory tier's peer transport: a put and a fetch of one file over TCP on 127.0.0.1, vs a
plain local copy of the same bytes.

    python benchmarks/peer_transport.py [--mib 256] [--repeats 3] [--dir DIR]

One file of ``--mib`` MiB under ``--dir`` (default: /dev/shm, where the memory tier keeps its
files; else a temporary directory). In one run, alternating, ``--repeats`` times each:

- copy: ``shutil.copyfile`` of the file to another name in the same directory (the baseline:
  what moving the bytes costs without a network);
- put: ``PeerClient.put_file`` to a ``PeerServer`` in another process serving a directory
  beside it (the server checks the CRC32C as it receives, fsyncs, renames);
- fetch: ``PeerClient.fetch_file`` of that file back (this process checks the CRC32C).

Reported: the median MB/s of each and its ratio to the copy's (the machine is shared: the
ratio, measured in the same run, is the figure to compare). The server runs in its own process
so that the two ends do not share one interpreter's GIL, as on two nodes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import REPO, table

from zephon.destinations.memory.peer import PeerClient
from zephon.storage import Crc32c

TOKEN = "benchmark-token"
_SERVER = (
    "import sys, time\n"
    "from zephon.destinations.memory.peer import PeerServer\n"
    "server = PeerServer(sys.argv[1], sys.argv[2], host='127.0.0.1')\n"
    "print(server.address[1], flush=True)\n"
    "sys.stdin.read()\n"  # serve until the benchmark closes our stdin
    "server.close()\n"
)


def write_source(path: str, size: int) -> str:
    """``size`` bytes of incompressible data at ``path``; their CRC32C."""
    crc = Crc32c()
    block = os.urandom(4 << 20)
    with open(path, "wb") as handle:
        left = size
        while left:
            piece = block[: min(left, len(block))]
            handle.write(piece)
            crc.update(piece)
            left -= len(piece)
    return crc.encoded()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    default_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    parser.add_argument("--dir", default=default_dir)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="zephon-peer-bench-", dir=args.dir)
    server = None
    try:
        size = args.mib << 20
        source = os.path.join(work, "source.bin")
        crc = write_source(source, size)
        served = os.path.join(work, "served")
        server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, served, TOKEN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        port = int(server.stdout.readline())
        client = PeerClient(("127.0.0.1", port), TOKEN, timeout_s=120)
        client.put_bytes(b"warm", "warm")  # the connection is open before the timings

        times: dict[str, list[float]] = {"copy": [], "put": [], "fetch": []}
        copy_dest = os.path.join(work, "copy.bin")
        fetch_dest = os.path.join(work, "fetched.bin")
        for _ in range(args.repeats):
            started = time.perf_counter()
            shutil.copyfile(source, copy_dest)
            times["copy"].append(time.perf_counter() - started)
            os.unlink(copy_dest)

            started = time.perf_counter()
            client.put_file(source, "step/rank0.distcp", crc, size)
            times["put"].append(time.perf_counter() - started)

            started = time.perf_counter()
            client.fetch_file("step/rank0.distcp", fetch_dest, crc, size)
            times["fetch"].append(time.perf_counter() - started)
            os.unlink(fetch_dest)
            client.delete("step")
        client.close()

        mb = size / 1e6
        copy = statistics.median(times["copy"])
        rows = []
        for name, spent in times.items():
            median = statistics.median(spent)
            rows.append((name, f"{median:.3f}", f"{mb / median:.0f}", f"{copy / median:.2f}x"))
        print(f"{args.mib} MiB on 127.0.0.1, files in {work}, median of {args.repeats}")
        print(table(rows, ("case", "seconds", "MB/s", "speed vs copy")))
        print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    finally:
        if server is not None:
            server.stdin.close()
            server.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
