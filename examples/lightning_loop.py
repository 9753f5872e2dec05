"""Lightning with the trainer's recovery (docs/library.md): generations instead of Lightning's
checkpoints, the trainer's keyed data order, SIGTERM saves and exits 75, a rerun resumes bit
for bit (Lightning's own `fit(ckpt_path="last")` does not: no RNG state, a new shuffle):

    python examples/lightning_loop.py runs/lightning
    python examples/lightning_loop.py runs/lightning-ddp --devices 2   # strategy="ddp", gloo
    torchrun --nproc_per_node 2 --max-restarts 1 examples/lightning_loop.py runs/lightning-t0 --devices 2 \
        --memory-dir /dev/shm/lightning-t0    # a lost rank: every rank restarts in place, from tier 0

With `--devices 2` Lightning's own launcher starts the second process (`lightning.launch`, before
`open_run`), which runs this script from the top; each rank trains its share of every batch.
Under torchrun Lightning finds the ranks torchrun started and starts none.
"""

import argparse
import logging
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

from trainer import recovery
from trainer.recovery import lightning


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.trainer.is_global_zero:
            print(f"step={self.trainer.global_step + 1} loss={loss.item():.4f}", flush=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output", help="the run directory (a path, or s3://bucket/run)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--devices", type=int, default=1, help="processes (strategy='ddp' from 2, on gloo)")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step (accumulate_grad_batches)")
    parser.add_argument("--batch-size", type=int, default=16, help="the global batch (a multiple of the processes)")
    parser.add_argument("--memory-dir", type=Path, help="tier 0: a directory on a memory filesystem (/dev/shm/...)")
    args = parser.parse_args()

    recovery.seed_everything(0)  # the same seed on every rank: every rank builds the same model
    inputs = torch.randn(192, 16)
    dataset = torch.utils.data.TensorDataset(inputs, inputs @ torch.randn(16, 1) + 0.1 * torch.randn(192, 1))
    module = Regression()
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=args.devices,
                         strategy="ddp" if args.devices > 1 else "auto", accumulate_grad_batches=args.accumulate,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False)
    lightning.launch(trainer)  # several devices: the other ranks start now, before the run is opened
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(message)s")
    memory = recovery.MemoryTierConfig(args.memory_dir, every_steps=1) if args.memory_dir else recovery.MemoryTierConfig()
    with recovery.open_run(args.output, resume="auto", recover=recovery.CadenceConfig(every_steps=10),
                           memory=memory) as run:
        callback = lightning.RecoveryCallback(run, recovery.KeyedData(dataset, batch_size=args.batch_size, seed=0))
        trainer.callbacks.append(callback)
        trainer.fit(module, train_dataloaders=callback.batches)


if __name__ == "__main__":
    main()
