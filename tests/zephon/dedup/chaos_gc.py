"""A gc process of the dedup chaos rounds (tests/zephon/dedup/chaos.py):

    python -m tests.zephon.dedup.chaos_gc '<json>'

Runs ``zephon.gc.collect_garbage`` over the run, pass after pass, with the given grace (and a
short pending grace and lease, so that what a killed saver or gc left is settled and taken
over within the round), until the file ``stop`` exists. With ``kill`` (a kill point of
``chaos_kills``) it SIGKILLs itself there. Prints one ``pass <n> deleted <steps> problems <n>``
line per pass; exits 2 on a pass that reports problems (with them on stderr).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time

from tests.zephon.dedup import chaos_kills


def main(args: dict) -> int:
    chaos_kills.install(args.get("kill"))
    from zephon.catalog import Catalog
    from zephon.gc import GcPolicy, collect_garbage

    policy = GcPolicy(
        grace=dt.timedelta(seconds=args["grace_s"]),
        pending_grace=dt.timedelta(seconds=args["pending_grace_s"]),
        lease=dt.timedelta(seconds=1),
        events_age=None,
    )
    passes = 0
    with Catalog(args["catalog"]) as catalog:
        while not os.path.exists(args["stop"]):
            report = collect_garbage(
                catalog,
                runs=[args["run"]],
                policy=policy,
                storage_options=args["storage_options"],
            )
            passes += 1
            deleted = sorted(d["step"] for d in report.deleted)
            print(f"pass {passes} deleted {deleted} problems {len(report.problems)}", flush=True)
            if report.problems:
                print("\n".join(report.problems), file=sys.stderr, flush=True)
                return 2
            time.sleep(args.get("pause_s", 0.05))
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
