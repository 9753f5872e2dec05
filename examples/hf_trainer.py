"""Hugging Face `Trainer` with the trainer's recovery (docs/library.md): HF keeps its loop; the
checkpoints are verified generations, SIGTERM saves the step reached and exits 75, and a
rerun resumes exactly. A tiny GPT-2 on generated tokens, on the CPU, in one process or several
(HF's DDP; each rank's share of every batch from HF's own distributed sampler):

    python examples/hf_trainer.py runs/hf
    torchrun --nproc_per_node 2 examples/hf_trainer.py runs/hf-ddp
    torchrun --nproc_per_node 3 --max-restarts 1 examples/hf_trainer.py runs/hf-3 --memory-dir /dev/shm/hf-3
                                                # a lost rank: every rank restarts in place, from tier 0
"""

import argparse
import logging
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from trainer import recovery
from trainer.recovery import hf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output", help="the run directory (a path, or s3://bucket/run)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--memory-dir", type=Path, help="tier 0: a directory on a memory filesystem (/dev/shm/...)")
    parser.add_argument("--arguments-first", action="store_true",
                        help="build TrainingArguments (which creates the process group) before open_run")
    args = parser.parse_args()

    recovery.seed_everything(0)
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(message)s")
    tokens = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in tokens]
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))

    memory = recovery.MemoryTierConfig(args.memory_dir, every_steps=1) if args.memory_dir else recovery.MemoryTierConfig()
    arguments = lambda: TrainingArguments(output_dir=f"{args.output}/hf", num_train_epochs=args.epochs,  # noqa: E731
                                          learning_rate=3e-3, per_device_train_batch_size=8, save_strategy="steps",
                                          save_steps=5, seed=0, logging_steps=1, report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    training = arguments() if args.arguments_first else None  # creates the process group (env://) itself
    with recovery.open_run(args.output, resume="auto", memory=memory) as run:  # or first: it joins the group HF uses
        hf.train(Trainer(model=model, args=training or arguments(), train_dataset=dataset, callbacks=[StepLines()]), run)


class StepLines(hf.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"step={state.global_step} epoch={state.epoch:.3f}", flush=True)


if __name__ == "__main__":
    main()
