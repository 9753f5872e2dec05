"""What does fetching through the trainer's keyed order (`recovery.KeyedData`, the trainer's
own loop) cost against a plain shuffled DataLoader over the same map-style dataset?

    python bench/data_bench.py                 # 40 batches of 256 samples of 2048 floats, 5 rounds
    python bench/data_bench.py --quick

One epoch is read both ways in the same process, alternating round by round, at 0 and 2
DataLoader workers: the keyed order (`KeyedData.epoch_batches`: every sample fetched under the
global RNGs seeded from (seed, epoch, index), the loop's own streams put back once a batch)
and `DataLoader(dataset, batch_size, shuffle=True, num_workers)`. Figures are the median
wall time per sample over the rounds; keyed / plain is the ratio, 1.00 is free. Beside it, the
loop process's CPU time per sample: with no workers that is the fetch's cost itself, steadier
than wall time on a shared machine. Three datasets
of (features, label) pairs, the plain loop's of docs/library.md:

- `plain`: a `__getitem__` that draws nothing, undeclared: each sample is seeded anyway (the
  trainer cannot know it draws nothing).
- `declared`: the same, declaring `draws_from_global_rngs = False`: fetched unseeded.
- `augmenting`: noise from `random`, `np.random` and `torch.rand` on every sample, the
  torchvision habit: the DataLoader's draws depend on the worker, the keyed ones do not.
- `torch-only`: noise from `torch.rand` alone, declaring `draws_from_global_rngs = ("torch",)`
  (a torchvision pipeline): only torch's generator is seeded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer import recovery  # noqa: E402

warnings.filterwarnings("ignore")


class Pairs(Dataset):
    """(features, label) rows of two tensors, as a user's map-style dataset holds them."""

    def __init__(self, samples: int, features: int):
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(samples, features, generator=generator)
        self.labels = torch.randint(0, 10, (samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.features[index], self.labels[index]


class Declared(Pairs):
    draws_from_global_rngs = False


class Augmenting(Pairs):
    def __getitem__(self, index: int):
        scale = 1.0 + 0.01 * (random.random() + np.random.rand())
        return self.features[index] * scale + 0.01 * torch.rand(()), self.labels[index]


class TorchAugmenting(Pairs):
    draws_from_global_rngs = ("torch",)

    def __getitem__(self, index: int):
        return self.features[index] * (1.0 + 0.01 * torch.rand(())), self.labels[index]


DATASETS = {"plain": Pairs, "declared": Declared, "augmenting": Augmenting, "torch-only": TorchAugmenting}


def per_sample(batches, samples: int) -> tuple[float, float]:
    """Wall and this process's CPU seconds per sample (CPU: the cost itself, with no workers;
    wall: what the loop waits, with them)."""
    started, cpu = time.perf_counter(), time.process_time()
    for _ in batches:
        pass
    return (time.perf_counter() - started) / samples, (time.process_time() - cpu) / samples


def measure(dataset: Dataset, batch: int, workers: int, rounds: int) -> dict:
    keyed_data = recovery.KeyedData(dataset, batch_size=batch, seed=0, num_workers=workers)
    next(iter(keyed_data.epoch_batches(rounds, 0)))  # warm: the first fetch's imports, not counted
    plain, keyed = [], []
    for number in range(rounds):
        plain.append(per_sample(DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers), len(dataset)))
        keyed.append(per_sample(keyed_data.epoch_batches(number, 0), len(dataset)))
    plain_s, keyed_s = (statistics.median(wall for wall, _ in runs) for runs in (plain, keyed))
    plain_cpu, keyed_cpu = (statistics.median(cpu for _, cpu in runs) for runs in (plain, keyed))
    return {"workers": workers, "plain_us": plain_s * 1e6, "keyed_us": keyed_s * 1e6, "ratio": keyed_s / plain_s,
            "plain_cpu_us": plain_cpu * 1e6, "keyed_cpu_us": keyed_cpu * 1e6, "cpu_ratio": keyed_cpu / plain_cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40, help="batches per epoch")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--quick", action="store_true", help="4 batches of 64 samples of 256 floats, 1 round")
    parser.add_argument("--dir", type=Path, default=None, help="unused: this bench writes nothing")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.batches, args.batch, args.features, args.rounds = 4, 64, 256, 1
    torch.set_num_threads(1)
    rows = []
    for name, kind in DATASETS.items():
        dataset = kind(args.batches * args.batch, args.features)
        for workers in args.workers:
            rows.append({"dataset": name, **measure(dataset, args.batch, workers, args.rounds)})
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"{args.batches} batches of {args.batch} samples of {args.features} floats, median of {args.rounds} "
          f"rounds, load average {load}")
    print("| dataset | workers | KeyedData µs/sample | DataLoader µs/sample | keyed / plain | the same in the loop's "
          "CPU |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['dataset']} | {row['workers']} | {row['keyed_us']:.1f} | {row['plain_us']:.1f} | "
              f"{row['ratio']:.2f} | {row['keyed_cpu_us']:.1f} / {row['plain_cpu_us']:.1f} = {row['cpu_ratio']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "batch": args.batch, "batches": args.batches,
                                         "features": args.features, "rounds": args.rounds, "load": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
