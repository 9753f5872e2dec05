"""Recovery in your own PyTorch loop (docs/library.md): a plain loop that survives kill -9 and
SIGTERM and resumes bit for bit. Run it, stop it any way you like, run it again:

    python examples/own_loop.py runs/own-loop
"""

import argparse
import logging

import torch
from torch import nn

from trainer import recovery


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output", nargs="?", help="the run directory (a path, or s3://bucket/run; run by the "
                        "Polyaxon bundle: its run directory)")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    recovery.seed_everything(0)  # Python's, NumPy's and torch's RNGs, deterministic kernels, 1 thread
    inputs = torch.randn(192, 16)
    dataset = torch.utils.data.TensorDataset(inputs, inputs @ torch.randn(16, 1) + 0.1 * torch.randn(192, 1))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * 12)

    with recovery.open_run(args.output, resume="auto", recover=recovery.CadenceConfig(every_steps=10)) as run:
        run.restore(model, optimizer, scheduler, data=recovery.KeyedData(dataset, batch_size=16, seed=0))
        for epoch in run.epochs(args.epochs):
            for x, y in run.batches():  # the rest of this epoch, in the order a resume repeats
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                run.step(loss)  # the witness, saves on cadence; SIGTERM: save, then exit 75
                print(f"step={run.progress.global_step} epoch={epoch} loss={loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
