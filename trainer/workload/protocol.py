"""The `Workload` protocol: everything the training loop asks of a model, its data and its
optimizer. The loop depends on this protocol only, never on the example workload, so a
workload can be swapped without touching the loop.

What the trainer owns (and a workload must not do itself): seeding, the batch order and the
position inside an epoch (`trainer.batching`), device placement, mixed precision, saving and
restoring everything, including the global Python, NumPy and torch RNGs the workload may use
in the main process.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn


class FingerprintedDataset(Protocol):
    """A map-style dataset addressed by (epoch, index) keys, whose per-sample randomness
    derives from (seed, epoch, index) so DataLoader workers and resumes do not change it."""

    def __len__(self) -> int: ...

    def __getitem__(self, key: tuple[int, int]) -> Any: ...

    def fingerprint(self) -> str:
        """A digest of the data: the fingerprint's `dataset` field."""


class Workload(Protocol):
    def build_dataset(self) -> FingerprintedDataset: ...

    def build_model(self) -> nn.Module: ...

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer: ...

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler: ...

    def adopt_config(self, optimizer: torch.optim.Optimizer, scheduler) -> None:
        """After a restore under an allowed `config` drift: make the changed options take
        effect on the restored optimizer and scheduler."""

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The loss of one batch (already on the device) through `model`."""

    def architecture(self) -> dict:
        """What an export's config.json needs to rebuild the model without this package."""
