"""The toy workload whose loss uses an op torch has no deterministic CPU kernel for
(`Tensor.put_` without accumulation, checked against torch 2.13.0): under the trainer's
deterministic algorithms it raises inside the workload's own code (tests/test_gpu_hazards.py).
The CUDA ops a real model meets this way (interpolate, grid_sample and pooling backward, CTC
loss) raise the same error on a GPU."""

from __future__ import annotations

import torch

from toy import ToyWorkload  # a sibling module, as `python file.py` would find it


class Nondeterministic(ToyWorkload):
    def loss(self, model, batch):
        loss = super().loss(model, batch)
        scatter = torch.zeros(4)
        scatter.put_(torch.tensor([0, 1]), torch.tensor([1.0, 2.0]))  # no deterministic kernel
        return loss + 0.0 * scatter.sum()
