"""The example workload's data: a generated, deterministic classification dataset.

Per-sample randomness (the augmentation noise) is drawn from a generator seeded by
(seed, epoch, index), never from worker or global state, so any number of DataLoader workers
and any resume position yield the same samples.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch.utils.data import Dataset


class SyntheticClassification(Dataset):
    """Gaussian features labelled by a fixed random "teacher" network.

    Samples are fetched by (epoch, index) (`sample_at`) so the per-epoch augmentation is
    reproducible with its own keyed generator.
    """

    draws_from_global_rngs = False
    """Its noise comes from its own generator: the trainer skips keying the global RNGs for
    every sample (trainer/data/global_rngs.py), and checks the claim on one sample at start."""

    def __init__(self, samples: int, features: int, classes: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(samples, features, generator=generator)
        teacher = torch.randn(features, classes, generator=generator)
        self.labels = (self.inputs @ teacher).argmax(dim=1)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Epoch 0's sample (for inspection); the trainer calls `sample_at`."""
        return self.sample_at(0, index)

    def sample_at(self, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise_rng = np.random.default_rng([self.seed, epoch, index])
        noise = torch.from_numpy(noise_rng.normal(0.0, 0.1, self.inputs.shape[1]).astype(np.float32))
        return self.inputs[index] + noise, self.labels[index]

    def fingerprint(self) -> str:
        """sha256 of the generated tensors: changes if the data would change."""
        digest = hashlib.sha256()
        digest.update(self.inputs.numpy().tobytes())
        digest.update(self.labels.numpy().tobytes())
        return digest.hexdigest()
