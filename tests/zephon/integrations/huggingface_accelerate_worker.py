"""One accelerate job on every rank of a gloo group (``torchrun --nproc_per_node N``), for
tests/zephon/integrations/test_huggingface.py: resume through AcceleratorCheckpoints, train to
``steps`` saving at ``save_at``, write this rank's losses by step to ``<losses>.<rank>.json``
and the names of the files this rank downloaded to resume to ``<losses>.<rank>.downloads``.

    torchrun --nproc_per_node 2 huggingface_accelerate_worker.py SPEC_JSON
"""

from __future__ import annotations

import json
import sys

import torch


def main(spec: dict) -> None:
    from accelerate import Accelerator

    from zephon.integrations import download
    from zephon.integrations.accelerate import AcceleratorCheckpoints

    downloaded = []
    fetch_one = download._download

    def counted(reader, entry, into):  # the real download, recorded
        downloaded.append(entry.name)
        return fetch_one(reader, entry, into)

    download._download = counted

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(100 + accelerator.process_index)  # every rank draws its own data
    checkpoints = AcceleratorCheckpoints(
        accelerator,
        spec["save_dir"],
        "acc2",
        catalog=spec["catalog"],
        storage_options=spec["storage_options"],
        local_dir=spec["local_dir"],
    )
    start = checkpoints.load_state() or 0
    losses = {}
    for step in range(start + 1, spec["steps"] + 1):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if step in spec["save_at"]:
            checkpoints.save_state(step)
    checkpoints.close()
    with open(f"{spec['losses']}.{accelerator.process_index}.json", "w") as out:
        json.dump(losses, out)
    with open(f"{spec['losses']}.{accelerator.process_index}.downloads", "w") as out:
        json.dump(downloaded, out)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
