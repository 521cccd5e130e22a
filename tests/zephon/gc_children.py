"""Processes for the gc concurrency and crash tests.

    python -m tests.zephon.gc_children commit '<json>'

commits checkpoints one after another for ``seconds`` through the real save path, and after
each commit checks, from storage and the catalog, that none of the ``num_to_keep`` newest
committed checkpoints has been deleted. Prints ``committed <step>`` lines; exits 1 on a
violation, with the reason on stderr.
"""

from __future__ import annotations

import json
import sys
import time

from tests.zephon.saves import start
from zephon.catalog import Catalog
from zephon.locations import run_location
from zephon.saving import Save


def commit(args: dict) -> int:
    catalog = Catalog(args["catalog"])
    location = run_location(catalog.get_run(args["run"]), args["storage_options"])
    keep = args["num_to_keep"]
    deadline = time.monotonic() + args["seconds"]
    step = args.get("first_step", 0)
    attempt = start(location, catalog, resumed_from=step - 1 if step else None)
    while time.monotonic() < deadline:
        with Save.begin(attempt, step, catalog=catalog) as writer:
            writer.write_many({f"part-{i}.bin": bytes([i]) * 512 for i in range(5)})
            time.sleep(args.get("pending_s", 0.05))  # a pending row gc must leave alone
            writer.commit()
        print(f"committed {step}", flush=True)
        newest = set(range(max(0, step - keep + 1), step + 1))
        on_storage = set(location.runstore.committed_steps())
        in_catalog = {r.step for r in catalog.list_checkpoints(args["run"], states="committed")}
        for where, present in (("storage", on_storage), ("catalog", in_catalog)):
            if not newest <= present:
                print(
                    f"VIOLATION: {sorted(newest - present)} of the newest {keep} missing from "
                    f"{where} after committing {step}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        step += 1
    return 0


if __name__ == "__main__":
    mode, raw = sys.argv[1], sys.argv[2]
    sys.exit({"commit": commit}[mode](json.loads(raw)))
