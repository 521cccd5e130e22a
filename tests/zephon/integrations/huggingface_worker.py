"""One training job of a tiny Llama under the Hugging Face Trainer with ZephonCallback, for
tests/zephon/integrations/test_huggingface.py (run as a subprocess so it can be SIGKILLed).

    python huggingface_worker.py SPEC_JSON

SPEC: output_dir, save_dir, run, catalog (URL or null), storage_options, max_steps,
resume ("none" | "zephon" | "stock", or a list of them: one job after the other in this
process; "stock" is the Trainer's own resume_from_checkpoint=True, and a failing "stock" job is
reported on stdout as "stock resume failed: <error>"),
kill ("none" | "trainer_save" | "zephon_commit"),
kill_step, losses (path: the logged losses are written there as JSON).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 96, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(spec: dict) -> None:
    from transformers import Trainer

    kill_step = spec.get("kill_step")
    if spec["kill"] == "trainer_save":
        # SIGKILL inside the Trainer's own save, after the weights and before the RNG state
        # and trainer_state.json: checkpoint-N exists, incomplete.
        original = Trainer._save_rng_state

        def dying(self, output_dir):
            if self.state.global_step == kill_step:
                kill_self()
            return original(self, output_dir)

        Trainer._save_rng_state = dying
    elif spec["kill"] == "zephon_commit":
        # SIGKILL inside Zephon's save: every file uploaded (the last ones with the commit's
        # fence re-check), the marker not yet written.
        from zephon.storage.writer import CheckpointWriter

        original_marker = CheckpointWriter._create_marker

        def dying_marker(self, data):
            if self.step == kill_step:
                kill_self()
            return original_marker(self, data)

        CheckpointWriter._create_marker = dying_marker

    modes = spec["resume"] if isinstance(spec["resume"], list) else [spec["resume"]]
    for mode in modes:
        try:
            losses = job(spec, mode)
        except Exception as exc:
            if mode != "stock":
                raise
            print(f"stock resume failed: {type(exc).__name__}: {exc}", flush=True)
    with open(spec["losses"], "w") as out:
        json.dump(losses, out)


def job(spec: dict, mode: str) -> dict:
    """One training job (a fresh Trainer): returns its logged losses by step."""
    from transformers import Trainer, TrainingArguments, set_seed

    from zephon.integrations.huggingface import ZephonCallback, latest_checkpoint

    set_seed(0)
    args = TrainingArguments(
        output_dir=spec["output_dir"],
        max_steps=spec["max_steps"],
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=8,
        use_cpu=True,
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callback = ZephonCallback(
        spec["save_dir"],
        spec["run"],
        catalog=spec["catalog"],
        storage_options=spec["storage_options"],
        num_to_keep=spec.get("num_to_keep"),
    )
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=Tokens(), callbacks=[callback])
    resume = None
    if mode == "zephon":
        resume = latest_checkpoint(
            spec["save_dir"],
            spec["run"],
            catalog=spec["catalog"],
            storage_options=spec["storage_options"],
            local_dir=spec.get("local_dir"),
        )
        print("resuming from", resume, flush=True)
    elif mode == "stock":  # what the Trainer resolves True to, after the callback's on_init_end
        from transformers.trainer_utils import get_last_checkpoint

        print("resuming from", get_last_checkpoint(args.output_dir), flush=True)
        resume = True
    trainer.train(resume_from_checkpoint=resume)
    return {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e}


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
