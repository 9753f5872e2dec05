"""The example workload: an MLP on a generated classification dataset (no download), the
default `--workload`.

It implements `trainer.workload.protocol.Workload`. Randomness in the main process uses the
global Python, NumPy and torch RNGs on purpose (they are saved and restored, and the test
that skips one of them proves each matters); per-sample randomness inside the dataset
derives from (seed, epoch, index) through `sample_at`.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import nn

from trainer import compat
from trainer.options import positive_float, positive_int, unit_interval
from trainer.workload.data import SyntheticClassification
from trainer.workload.model import MLP


@dataclass(frozen=True)
class ExampleOptions:
    samples: int = 128
    """Size of the generated dataset; with batch_size 16 that is 8 batches per epoch."""
    lr: float = 0.05
    """Initial learning rate (SGD with momentum, decayed per step, independent of epochs)."""
    hidden_size: int = 64
    """Width of the hidden layers; raise it (with `layers`) to make checkpoints bigger."""
    layers: int = 2
    dropout: float = 0.1
    features: int = 16
    classes: int = 4
    seed: int = 1234

    @classmethod
    def of(cls, options: argparse.Namespace) -> ExampleOptions:
        return cls(**{f.name: getattr(options, f.name) for f in fields(cls) if hasattr(options, f.name)})


class ExampleWorkload:
    @staticmethod
    def add_options(group) -> None:
        defaults = ExampleOptions()
        group.add_argument("--samples", type=positive_int, default=defaults.samples, metavar="N",
                           help="samples in the generated dataset (an epoch is samples / --batch-size batches)")
        group.add_argument("--lr", type=positive_float, default=defaults.lr, metavar="LR",
                           help="initial learning rate (SGD with momentum, decayed per step)")
        group.add_argument("--hidden-size", type=positive_int, default=defaults.hidden_size, metavar="N",
                           help="width of each hidden layer")
        group.add_argument("--layers", type=positive_int, default=defaults.layers, metavar="N",
                           help="hidden layers")
        group.add_argument("--dropout", type=unit_interval, default=defaults.dropout, metavar="P",
                           help="dropout probability (exercises the RNG that a resume must restore)")
        group.set_defaults(features=defaults.features, classes=defaults.classes)

    def __init__(self, options: argparse.Namespace):
        self.config = ExampleOptions.of(options)

    def build_dataset(self) -> SyntheticClassification:
        c = self.config
        return SyntheticClassification(c.samples, c.features, c.classes, c.seed)

    def build_model(self) -> nn.Module:
        c = self.config
        return MLP(c.features, c.hidden_size, c.layers, c.classes, c.dropout)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.config.lr, momentum=0.9, weight_decay=1e-4)

    def build_scheduler(self, optimizer: torch.optim.Optimizer):
        # Decays per optimizer step and never looks at the epoch count, so extending a run
        # with a larger --epochs continues the same schedule.
        return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.98)

    def adopt_config(self, optimizer: torch.optim.Optimizer, scheduler) -> None:
        """After a restore under an allowed `config` drift. The restored optimizer and
        scheduler carry the learning rate they were built with, which would silently win
        over a changed `--lr`: rescale the schedule to the configured rate, keeping the
        decay it has reached (lr = new base × the factor so far)."""
        for index, group in enumerate(optimizer.param_groups):
            base = scheduler.base_lrs[index]
            if base != self.config.lr:
                group["lr"] = group["lr"] * (self.config.lr / base)
                group["initial_lr"] = self.config.lr
                scheduler.base_lrs[index] = self.config.lr
        compat.set_scheduler_last_lr(scheduler, [group["lr"] for group in optimizer.param_groups])

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, labels = batch
        # Batch-level augmentation in the main process, deliberately using the global RNGs so
        # that an exact resume has to restore them: NumPy noise and a Python-random scale.
        noise = torch.from_numpy(np.random.normal(0.0, 0.02, tuple(inputs.shape)).astype(np.float32))
        scale = random.uniform(0.9, 1.1)
        inputs = (inputs + noise.to(inputs.device)) * scale
        return nn.functional.cross_entropy(model(inputs), labels)

    def architecture(self) -> dict:
        """What an export's config.json needs to rebuild the model without this package."""
        c = self.config
        return {"architecture": "MLP", "features": c.features, "hidden_size": c.hidden_size,
                "layers": c.layers, "classes": c.classes, "dropout": c.dropout}
