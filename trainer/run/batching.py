"""The batch order: which samples each optimizer step trains on, owned by the trainer.

A workload supplies a dataset addressed by (epoch, index); the trainer decides the order.
Because the order is a pure function of (seed, epoch) and a batch position, the saved
progress alone restores it exactly, at any world size.
"""

from __future__ import annotations

import torch

from trainer.config import WorkloadConfig
from trainer.errors import UsageError
from trainer.workload.protocol import TrainingSteps


class EpochBatchOrder:
    """This rank's share of the batches of (epoch, index) keys for one epoch, starting at a
    batch position.

    The permutation, and so every global batch, is a pure function of (seed, epoch): the
    data-order "generator" is re-created from those two numbers, so the saved position alone
    restores it exactly. With several processes each rank takes every `world_size`-th sample
    of each global batch, starting at its rank, so together the ranks consume exactly the
    global batch a single process would, and any world size resumes from the same position.
    """

    def __init__(self, samples: int, batch_size: int, seed: int, epoch: int, start_batch: int,
                 rank: int = 0, world_size: int = 1):
        self.samples, self.batch_size = samples, batch_size
        self.seed, self.epoch, self.start_batch = seed, epoch, start_batch
        self.rank, self.world_size = rank, world_size

    def permutation(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.samples, generator=generator)

    def __iter__(self):
        order = self.permutation().tolist()
        for start in range(self.start_batch * self.batch_size, self.samples, self.batch_size):
            batch = order[start:start + self.batch_size]
            yield [(self.epoch, index) for index in batch[self.rank::self.world_size]]

    def __len__(self) -> int:
        return max(0, -(-self.samples // self.batch_size) - self.start_batch)


def uneven_split(samples: int, batch_size: int, world_size: int, named: str | None = None) -> str | None:
    """Why the global batches cannot be split evenly across `world_size` ranks, or None.
    `named`: where the batch size came from, as the line says it (`WorkloadConfig.named`:
    the flag, or an adopted DataLoader's batch_size, which is refused the same way).

    Every batch, the last one of an epoch included, must divide evenly: gradients are
    averaged per rank, so unequal slices would weigh samples unequally (and an empty slice
    would leave a rank with nothing to train on)."""
    last = samples % batch_size or batch_size
    if batch_size % world_size == 0 and last % world_size == 0:
        return None
    return (f"{named or f'--batch-size {batch_size}'} (last batch of an epoch: {last} of {samples} samples) does "
            f"not divide evenly across {world_size} processes; choose sizes that are multiples of {world_size}")


def require_even_split(samples: int, config: WorkloadConfig, world_size: int) -> None:
    """Refuse (exit 2) a batch size the ranks cannot share evenly (see `uneven_split`)."""
    if problem := uneven_split(samples, config.batch_size, world_size, config.named("batch_size")):
        raise UsageError(problem)


def training_steps(samples: int, config: WorkloadConfig) -> TrainingSteps:
    """The run's optimizer steps: an epoch's batches in windows of --grad-accum (the last one
    may be shorter), times --epochs, or --max-steps when given (a stream's step budget)."""
    batches_per_epoch = len(EpochBatchOrder(samples, config.batch_size, config.seed, 0, 0))
    per_epoch = -(-batches_per_epoch // config.grad_accum)
    return TrainingSteps(per_epoch, config.max_steps or config.epochs * per_epoch)
