"""A user's workload, outside the trainer package, the way the README tells users to write one:
dict batches, global-RNG augmentation inside the dataset (the torchvision habit), gradient
clipping in `after_backward`, extra state of its own, and no dataset fingerprint.

`--optimizer accumulating` swaps in an accumulation wrapper whose state is created lazily
(the silent fresh-state failure of issue #13: it must be refused, never restored fresh).
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from trainer.options import positive_float, positive_int


class NoisyRegression(torch.utils.data.Dataset):
    def __init__(self, samples: int, features: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(samples, features, generator=generator)
        self.targets = self.inputs.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict:
        # Global-RNG augmentation in the dataset, as torchvision transforms do.
        jitter = torch.randn(self.inputs.shape[1]) * 0.1 + np.random.normal(0, 0.1) + random.uniform(-0.1, 0.1)
        return {"inputs": self.inputs[index] + jitter, "target": self.targets[index]}


class Counter:
    """Extra workload state: how many optimizer steps it has seen (and a running norm)."""

    def __init__(self):
        self.steps = torch.zeros((), dtype=torch.int64)
        self.norm = torch.zeros(())

    def state_dict(self) -> dict:
        return {"steps": self.steps, "norm": self.norm}

    def load_state_dict(self, state: dict) -> None:
        self.steps.copy_(state["steps"])
        self.norm.copy_(state["norm"])


class AccumulatingSGD(torch.optim.SGD):
    """Only every 4th call steps: its state appears lazily, after the zero steps."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure) if self.calls % 4 == 0 else None


class ToyWorkload:
    @staticmethod
    def add_options(group) -> None:
        group.add_argument("--width", type=positive_int, default=8)
        group.add_argument("--toy-lr", type=positive_float, default=0.05)
        group.add_argument("--toy-samples", type=positive_int, default=24)
        group.add_argument("--optimizer", choices=("sgd", "accumulating"), default="sgd")
        group.set_defaults(features=4)

    def __init__(self, options):
        self.options = options
        self.counter = Counter()

    def build_dataset(self):
        return NoisyRegression(self.options.toy_samples, self.options.features, self.options.seed)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.options.features, self.options.width), nn.ReLU(), nn.Dropout(0.1),
                             nn.Linear(self.options.width, 1))

    def build_optimizer(self, model):
        kind = torch.optim.SGD if self.options.optimizer == "sgd" else AccumulatingSGD
        return kind(model.parameters(), lr=self.options.toy_lr, momentum=0.9)

    def build_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))

    def loss(self, model, batch: dict) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch["inputs"]), batch["target"])

    def after_backward(self, model, optimizer) -> None:
        self.counter.norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).detach()

    def after_step(self, model, optimizer) -> None:
        self.counter.steps += 1

    def stateful(self) -> dict:
        return {"counter": self.counter}

    def architecture(self) -> dict:
        return {"architecture": "toy-mlp", "features": self.options.features, "width": self.options.width}
