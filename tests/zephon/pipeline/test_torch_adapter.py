"""The torch Stateful adapter, and that the pipeline itself never needs torch."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from tests.zephon.pipeline.util import keys_of, simple_pipeline
from zephon.pipeline import PipelineStateError

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_state_dict_round_trip_resumes_exactly():
    from zephon import PipelineStateful

    reference = keys_of(simple_pipeline(shuffle=5))
    p = simple_pipeline(shuffle=5)
    it = iter(p)
    first = keys_of(next(it) for _ in range(6))
    saved = PipelineStateful(p).state_dict()
    assert isinstance(saved["zephon_pipeline_state"], str)

    q = simple_pipeline(shuffle=5)
    PipelineStateful(q).load_state_dict(saved)
    assert first + keys_of(q) == reference


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_dict_survives_torch_save_and_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    from zephon import PipelineStateful

    p = simple_pipeline(shuffle=5)
    it = iter(p)
    for _ in range(3):
        next(it)
    expected = p.checkpoint()
    dcp.save({"data": PipelineStateful(p)}, checkpoint_id=str(tmp_path / "dcp"))

    q = simple_pipeline(shuffle=5)
    dcp.load({"data": PipelineStateful(q)}, checkpoint_id=str(tmp_path / "dcp"))
    assert q.checkpoint() == expected


def test_load_state_dict_refuses_a_dict_without_the_state():
    from zephon import PipelineStateful

    with pytest.raises(PipelineStateError, match="zephon_pipeline_state"):
        PipelineStateful(simple_pipeline()).load_state_dict({"zephon_pipeline_state": None})


def test_the_pipeline_imports_and_runs_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
        "import zephon, zephon.pipeline\n"
        "from tests.zephon.pipeline.util import simple_pipeline\n"
        "assert sum(len(b) for b in simple_pipeline(shuffle=3)) == 185\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n    zephon.PipelineStateful\nexcept ImportError:\n    print('adapter needs torch')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "adapter needs torch" in out.stdout


@pytest.mark.slow
def test_every_rank_saves_the_merged_state_and_dcp_restores_it(tmp_path):
    """Two gloo ranks: each saves the merged state checkpoint() gave it, DCP saves and loads it."""
    from tests.ranks import launch
    from tests.zephon.pipeline.agg_worker import build

    config = {"workdir": str(tmp_path)}
    results = launch("tests.zephon.pipeline.dist_worker", 2, config, timeout=180)
    assert results[0]["saved"] == results[1]["saved"]
    state = json.loads(results[0]["saved"]["zephon_pipeline_state"])
    # group 0 read lanes 0, 2, 0 and group 1 lanes 1, 3, 1
    assert [lane["batches"] for lane in state["lanes"]] == [2, 2, 1, 1]

    # each rank continues where its group stopped
    for rank in (0, 1):
        reference = build(rank, 2, 2, str(tmp_path / "ref"), {}, "ref", 60)
        keys = keys_of(itertools.islice(reference, 5))
        assert results[rank]["after"] == [list(k) for k in keys[12:20]]
        reference.close()
