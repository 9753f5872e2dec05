"""Lightning with the trainer's recovery (docs/library.md): generations instead of Lightning's
checkpoints, the trainer's keyed data order, SIGTERM saves and exits 75, a rerun resumes bit
for bit (Lightning's own `fit(ckpt_path="last")` does not: no RNG state, a new shuffle):

    python examples/lightning_loop.py runs/lightning
"""

import argparse
import logging

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
        print(f"step={self.trainer.global_step + 1} loss={loss.item():.4f}", flush=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output", help="the run directory (a path, or s3://bucket/run)")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    recovery.seed_everything(0)
    inputs = torch.randn(192, 16)
    dataset = torch.utils.data.TensorDataset(inputs, inputs @ torch.randn(16, 1) + 0.1 * torch.randn(192, 1))
    module = Regression()
    with recovery.open_run(args.output, resume="auto", recover=recovery.CadenceConfig(every_steps=10)) as run:
        callback = lightning.RecoveryCallback(run, recovery.KeyedData(dataset, batch_size=16, seed=0))
        trainer = pl.Trainer(max_epochs=args.epochs, callbacks=[callback], enable_checkpointing=False, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(module, train_dataloaders=callback.batches)


if __name__ == "__main__":
    main()
