"""A training loop with Zephon checkpointing: run it, interrupt it (Ctrl-C, or kill it), run it
again and it continues from its latest checkpoint; once finished, it says so and stops.

    python examples/train.py examples/job.yaml
    python examples/train.py examples/job.yaml --total-steps 60    # raised total_steps: continues
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import zephon


def build_pipeline() -> zephon.Pipeline:
    rows = [{"x": [float(i % 7), float(i % 5)], "y": float(i % 3)} for i in range(4096)]
    dataset = zephon.Dataset.from_dict("example", {"all": zephon.InMemoryShard(rows)})
    source = zephon.StaticMixtureWorkSource([dataset], None, chunk_size=256, stop_after_passes=None)
    return zephon.Pipeline(source).shuffle(512).batch(32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--total-steps", type=int, help="override trainer.total_steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)

    job = zephon.load_job_config(args.config)
    total_steps = args.total_steps or job.total_steps
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (total_steps + 1))
    pipeline = build_pipeline()
    state = {
        "model": model,
        "optimizer": optimizer,
        "lr_scheduler": scheduler,
        "data": zephon.PipelineStateful(pipeline),
    }

    with zephon.CheckpointManager(
        job.checkpointing,
        run_name=job.run_name,
        total_steps=total_steps,
        model_stage=job.model_stage,
    ) as manager:
        resume = manager.load_latest(state)
        if resume.finished:
            return
        if resume.resumed:
            logging.info("resumed from %s, continuing at step %d", resume.url, resume.next_step)
        batches = iter(pipeline)
        for step in range(resume.next_step, total_steps + 1):
            batch = next(batches)
            x = torch.tensor([r["x"] for r in batch.payloads])
            y = torch.tensor([[r["y"]] for r in batch.payloads])
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if manager.maybe_save(step, state):
                logging.info("step %d: loss %.4f, saved", step, loss.item())
        manager.finish()
    pipeline.close()


if __name__ == "__main__":
    main()
