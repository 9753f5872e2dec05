"""An Accelerate training loop with the trainer's recovery (docs/library.md): `save_state` and
`load_state` go through verified generations, the data through the keyed order, so a kill -9
or a SIGTERM mid-epoch resumes bit for bit, in one process or several (each rank its share of
every global batch of 16):

    python examples/accelerate_loop.py runs/accelerate
    torchrun --nproc_per_node 2 examples/accelerate_loop.py runs/accelerate-ddp
    torchrun --nproc_per_node 3 --max-restarts 1 examples/accelerate_loop.py runs/acc-3 --batch-size 24 \
        --memory-dir /dev/shm/acc-3    # a lost rank: every rank restarts in place, from tier 0
"""

import argparse
import logging
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from trainer import recovery
from trainer.recovery import accelerated


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output", help="the run directory (a path, or s3://bucket/run)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="the global batch (a multiple of the processes)")
    parser.add_argument("--memory-dir", type=Path, help="tier 0: a directory on a memory filesystem (/dev/shm/...)")
    parser.add_argument("--accelerator-first", action="store_true",
                        help="create the Accelerator (and with it the process group) before open_run")
    args = parser.parse_args()

    recovery.seed_everything(0)
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(message)s")
    memory = recovery.MemoryTierConfig(args.memory_dir, every_steps=1) if args.memory_dir else recovery.MemoryTierConfig()
    accelerator = Accelerator(cpu=True) if args.accelerator_first else None  # creates the process group (env://)
    with recovery.open_run(args.output, resume="auto", recover=recovery.CadenceConfig(every_steps=10),
                           memory=memory) as run:  # or first: under torchrun it joins the process group Accelerate uses
        accelerator = accelerator or Accelerator(cpu=True)  # on a CPU host Accelerator() is one process under torchrun
        inputs = torch.randn(192, 16)
        dataset = torch.utils.data.TensorDataset(inputs, inputs @ torch.randn(16, 1) + 0.1 * torch.randn(192, 1))
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * 192 // args.batch_size)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        accelerated.load_state(accelerator, run, data=recovery.KeyedData(dataset, batch_size=args.batch_size, seed=0),
                               model=model)  # as prepared: DDP on several processes
        for epoch in run.epochs(args.epochs):
            for x, y in accelerated.batches(accelerator, run):  # the keyed order on accelerator.device
                loss = nn.functional.mse_loss(model(x), y) * run.weight  # a ragged last batch's share
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                run.step(loss)  # the witness, saves on cadence; SIGTERM: save, then exit 75
                if accelerator.is_main_process:
                    print(f"step={run.progress.global_step} epoch={epoch} loss={loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
