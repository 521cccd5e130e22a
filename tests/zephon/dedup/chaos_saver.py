"""The saving job of the dedup chaos rounds (tests/zephon/dedup/chaos.py), one attempt per run:

    python -m tests.zephon.dedup.chaos_saver '<json>'

A restarted training job: the checkpoint manager with ``dedup: true``, ``num_to_keep`` small
and a SQLite catalog loads the latest checkpoint (``load_latest``, which registers a new
attempt), then saves every step for ``saves`` steps. Its state is a frozen base (the same
bytes in every attempt: deduplicated against the previous attempt's checkpoints) and two
tensors that change, their values a function of the step (``expected_state``), so whoever
reads a checkpoint knows what it must hold.

Prints ``resumed <step|none>`` and ``saved <step>`` lines; with ``kill`` (a kill point of
``chaos_kills``) it SIGKILLs itself there. Exits 3 if what it loaded is not what was saved at
that step.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from tests.zephon.dedup import chaos_kills

#: the frozen base: tensors that never change (one chunk each); the adapter changes every step,
#: ``slow`` every third step (a chunk that a few checkpoints share without being the base's)
BASE_TENSORS = 3
BASE_SHAPE = (256, 512)  # 512 KiB of float32 each
ADAPTER_SHAPE = (16, 512)
SLOW_SHAPE = (64, 512)


class Model(nn.Module):
    """The saved module: the base (frozen, from a fixed seed), an adapter, a slow tensor."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1234)
        self.base = nn.ParameterList(
            nn.Parameter(torch.randn(BASE_SHAPE, generator=generator), requires_grad=False)
            for _ in range(BASE_TENSORS)
        )
        self.adapter = nn.Parameter(torch.zeros(ADAPTER_SHAPE))
        self.slow = nn.Parameter(torch.zeros(SLOW_SHAPE), requires_grad=False)

    def set_step(self, step: int) -> None:
        with torch.no_grad():
            self.adapter.fill_(float(step))
            self.slow.fill_(float(step // 3))


def expected_state(step: int) -> dict[str, torch.Tensor]:
    """The model's state dict as the saver saved it at ``step``."""
    model = Model()
    model.set_step(step)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def manager_config(args: dict):
    from zephon.config import CheckpointingConfig

    return CheckpointingConfig(
        save_dir=args["url"],
        storage_options=args["storage_options"],
        period_steps=1,
        num_to_keep=args["num_to_keep"],
        catalog_url=args["catalog"],
        dedup=True,
    )


def main(args: dict) -> int:
    from zephon.checkpointing import CheckpointManager

    chaos_kills.install(args.get("kill"))
    model = Model()
    with CheckpointManager(manager_config(args), run_name=args["run"], total_steps=10**6) as m:
        resume = m.load_latest({"model": model})
        print(f"resumed {resume.step if resume.step is not None else 'none'}", flush=True)
        if resume.step is not None:
            want = expected_state(resume.step)
            for key, value in model.state_dict().items():
                if not torch.equal(value, want[key]):
                    print(f"loaded {key} of step {resume.step} differs", file=sys.stderr)
                    return 3
        first = resume.next_step
        for step in range(first, first + args["saves"]):
            model.set_step(step)
            m.save(step, {"model": model})
            print(f"saved {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
