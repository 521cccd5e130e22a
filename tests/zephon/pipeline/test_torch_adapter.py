"""The torch Stateful adapter, and that the pipeline itself never needs torch."""

from __future__ import annotations

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
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "adapter needs torch" in out.stdout
