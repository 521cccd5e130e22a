"""How many requests a drop-in DCP save and load send one after another on moto's S3 server,
counted by the latency proxy (``LatencyProxy.longest_chain``: requests sent together count as
one link). A save with a catalog ends at its marker (its retention judges by the attempt's own
lineage, no read of the run's attempts after the marker); a load reads the marker, which
carries the DCP metadata, with one GET, and a latest load checks the catalog's answer with
the marker."""

from __future__ import annotations

import json
import os
import sys

import torch

from zephon import dcp as zd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from latency_proxy import LatencyProxy  # noqa: E402

#: held back only while measuring: long enough that requests sent together reach the proxy
#: well within it on a busy machine
DELAY_MS = 500


def test_save_and_load_chains(catalog, s3_backend):
    upstream = s3_backend.storage_options["client_kwargs"]["endpoint_url"]
    url = f"{s3_backend.url}/r"
    state = {f"t{i}": torch.full((16,), float(i)) for i in range(20)}
    with LatencyProxy(upstream, 0) as proxy:
        options = json.loads(json.dumps(s3_backend.storage_options))
        options["client_kwargs"]["endpoint_url"] = proxy.url
        with zd.Writer(url, catalog=catalog, storage_options=options) as writer:
            zd.save(state, writer, checkpoint_id=f"{url}/save-1")  # registers the attempt
            proxy.reset()
            proxy.delay_ms = DELAY_MS
            zd.save(state, writer, checkpoint_id=f"{url}/save-2")
            proxy.delay_ms = 0
            lines = proxy.request_lines
            # begin's marker probe, the shards, the metadata with the payload listing and the
            # fence re-check, the marker: nothing after it
            assert proxy.longest_chain <= 4, lines
            assert lines[-1].startswith("PUT ") and "/save-2/_COMMIT" in lines[-1], lines
            assert not any(".resume.json" in line for line in lines), lines
            assert sum("_attempts" in line for line in lines) == 1, lines

        for step in (2, None):
            target = {k: torch.zeros(16) for k in state}
            proxy.reset()
            proxy.delay_ms = DELAY_MS
            with zd.Reader(url, step=step, catalog=catalog, storage_options=options) as reader:
                zd.load(target, reader)
            proxy.delay_ms = 0
            assert reader.step == 2 and all(torch.equal(target[k], state[k]) for k in state)
            # the marker with the metadata (for the latest, its checks sent together), shards
            assert proxy.longest_chain == 2, proxy.request_lines
