"""The toy workload with data code that fails, for issue #30 (nothing may hang):

- `--failure raise-at INDEX`: `__getitem__` raises ValueError on one record (in a DataLoader
  worker with --num-workers 1+, in the main process with 0);
- `--failure kill-at INDEX`: the process fetching that record kills itself with SIGKILL (a
  worker lost to the OOM killer);
- `--failure abstract`: a `torch.utils.data.Dataset` subclass without `__getitem__`
  (torch's base raises NotImplementedError);
- `--failure loss`: the loss raises on the second step (a shape mistake in the user's model).

`--linger-at-exit DIR` keeps the failed trainer alive at interpreter exit, after its attempt
was recorded, until a test has signalled it (it writes DIR/exiting, then waits for
DIR/signalled): the window in which a stop signal must not turn the failure into 75.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from pathlib import Path

import torch

from toy import NoisyRegression, ToyWorkload  # a sibling module, as `python file.py` would find it


class FailingRecords(NoisyRegression):
    def __init__(self, samples: int, features: int, seed: int, failure: str, at: int):
        super().__init__(samples, features, seed)
        self.failure, self.at = failure, at

    def __getitem__(self, index: int) -> dict:
        if index == self.at and self.failure == "raise-at":
            raise ValueError(f"corrupt record {index}")
        if index == self.at and self.failure == "kill-at":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


class WithoutGetItem(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24


class FailingData(ToyWorkload):
    @staticmethod
    def add_options(group) -> None:
        ToyWorkload.add_options(group)
        group.add_argument("--failure", choices=("raise-at", "kill-at", "abstract", "loss"), default="raise-at")
        group.add_argument("--failing-index", type=int, default=5)
        group.add_argument("--linger-at-exit", default=None)

    losses = 0

    def loss(self, model, batch):
        if self.options.failure == "loss":
            return loss_that_fails(self, model, batch)
        return super().loss(model, batch)

    def build_dataset(self):
        if self.options.linger_at_exit:
            atexit.register(linger, Path(self.options.linger_at_exit))
        if self.options.failure == "abstract":
            return WithoutGetItem()
        return FailingRecords(self.options.toy_samples, self.options.features, self.options.seed,
                              self.options.failure, self.options.failing_index)


def linger(folder: Path) -> None:
    (folder / "exiting").touch()
    deadline = time.monotonic() + 120
    while not (folder / "signalled").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def loss_that_fails(workload: FailingData, model, batch):
    workload.losses += 1
    if workload.losses == 2:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x4 and 5x8)")
    return ToyWorkload.loss(workload, model, batch)
