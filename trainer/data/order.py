"""The batch order: which samples each optimizer step trains on, owned by the trainer.

A workload supplies a dataset addressed by (epoch, index); the trainer decides the order.
Because the order is a pure function of (seed, epoch) and a batch position, the saved
progress alone restores it exactly, at any world size.

An epoch's last batch is ragged when the batch size does not divide the samples. What then
is a choice (`--last-batch`, `EpochShape`):

- `pad` (the default: every sample trained once per epoch, as a plain DataLoader's
  `drop_last=False`): the short batch is trained. Each rank takes every world-size-th of its
  samples, so shares may be unequal; each rank's loss is weighted by its share
  (`EpochShape.weight`: world size × its samples ÷ the batch's), so the gradient DDP averages
  is the mean over the batch's samples, each counted once, as one process would compute it.
  A rank whose share is empty (fewer samples than processes) trains on the batch's first
  sample at loss weight 0: it runs forward and backward like the others (the collectives
  need every rank) and adds nothing; the ledger records it as padding, not as a sample.
- `drop`: the short batch is not trained; the ledger's cursors count an epoch's trained
  samples, and `report` counts the dropped ones per epoch.
- `refuse`: a last batch the processes cannot share evenly stops the run before its first
  step (exit 2), for runs that want every rank's share of every batch equal.

Whatever the choice, the batch size itself must divide by the world size: every full batch
is shared evenly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from trainer.config import WorkloadConfig
from trainer.errors import UsageError, option
from trainer.workload.protocol import TrainingSteps

PAD, DROP, REFUSE = "pad", "drop", "refuse"


class Fetched(NamedTuple):
    """One micro-batch of a rank, as a data source's `loader` gives it."""

    ids: torch.Tensor
    """The sample ids trained on, in order (for the ledger): a padded share's repeated sample
    when `weight` is 0."""
    batch: object
    weight: float
    """The loss weight of this rank's share (`EpochShape.weight`)."""

    @property
    def padded(self) -> bool:
        return self.weight == 0.0


@dataclass(frozen=True)
class EpochShape:
    """An epoch's batches: how many, how many samples each, each rank's share and its weight."""

    samples: int
    batch_size: int
    last_batch: str = PAD

    @property
    def batches(self) -> int:
        if self.last_batch == DROP:
            return self.samples // self.batch_size
        return -(-self.samples // self.batch_size)

    @property
    def trained(self) -> int:
        """Samples trained per epoch (the ledger's cursors count these)."""
        return min(self.samples, self.batches * self.batch_size)

    @property
    def dropped(self) -> int:
        """Samples an epoch leaves untrained (`--last-batch drop`)."""
        return self.samples - self.trained

    def batch_samples(self, batch: int) -> int:
        return min(self.batch_size, self.trained - batch * self.batch_size)

    def share(self, batch: int, rank: int, world_size: int) -> range:
        """The batch's slots (0 .. its samples) rank `rank` trains on: every world-size-th."""
        return range(rank, self.batch_samples(batch), world_size)

    def weight(self, batch: int, rank: int, world_size: int) -> float:
        """The loss weight of rank `rank`'s share: 1 when the ranks share the batch evenly,
        world size × share ÷ the batch's samples otherwise (0 for a padded rank)."""
        samples, share = self.batch_samples(batch), len(self.share(batch, rank, world_size))
        return 1.0 if share * world_size == samples else world_size * share / samples


class EpochBatchOrder:
    """This rank's share of the batches of (epoch, index) keys for one epoch, starting at a
    batch position, as (keys, loss weight).

    The permutation, and so every global batch, is a pure function of (seed, epoch): the
    data-order "generator" is re-created from those two numbers, so the saved position alone
    restores it exactly. With several processes each rank takes every `world_size`-th sample
    of each global batch, starting at its rank, so together the ranks consume exactly the
    global batch a single process would, and any world size resumes from the same position.
    A rank whose share of the last batch is empty gets the batch's first key at weight 0.
    """

    def __init__(self, shape: EpochShape, seed: int, epoch: int, start_batch: int, rank: int = 0,
                 world_size: int = 1):
        self.shape, self.seed, self.epoch, self.start_batch = shape, seed, epoch, start_batch
        self.rank, self.world_size = rank, world_size

    def permutation(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.shape.samples, generator=generator)

    def weighted(self):
        """(keys, loss weight) of each of this rank's batches."""
        order, shape = self.permutation().tolist(), self.shape
        for batch in range(self.start_batch, shape.batches):
            start = batch * shape.batch_size
            share = [start + slot for slot in shape.share(batch, self.rank, self.world_size)] or [start]
            yield [(self.epoch, order[at]) for at in share], shape.weight(batch, self.rank, self.world_size)

    def __iter__(self):
        return (keys for keys, _ in self.weighted())

    def __len__(self) -> int:
        return max(0, self.shape.batches - self.start_batch)


def uneven_split(shape: EpochShape, world_size: int, named: str | None = None) -> str | None:
    """Why the batches cannot be shared across `world_size` ranks, or None. `named`: where the
    batch size came from, as the line says it (`WorkloadConfig.named`: the flag, or an adopted
    DataLoader's batch_size, which is refused the same way).

    Every full batch must divide evenly: gradients are averaged per rank, and `weight` evens
    out only the last batch's shares. Under `--last-batch refuse` the last batch must too;
    under `drop`, an epoch must hold at least one full batch. Data the trainer does not batch
    (no samples: a library loop that reads its own, trainer/recovery/) has nothing to share."""
    if not shape.samples:
        return None  # e.g. Hugging Face's Trainer under torchrun: its sampler shares its own batches
    named = named or option("--batch-size", shape.batch_size)
    if shape.batch_size % world_size:
        return (f"{named} does not divide evenly across {world_size} processes (each takes an equal share of "
                f"every batch); choose a multiple of {world_size}")
    last = shape.samples % shape.batch_size
    if shape.last_batch == REFUSE and last % world_size:
        return (f"{named} (last batch of an epoch: {last} of {shape.samples} samples) does not divide evenly "
                f"across {world_size} processes under {option('--last-batch', REFUSE)}; choose sizes that are "
                f"multiples of {world_size}, or {option('--last-batch', 'pad')} (weighted shares) or drop")
    if shape.samples and shape.batches == 0:
        return (f"{named} is larger than the {shape.samples} samples of an epoch, which --last-batch drop "
                f"would leave untrained; choose a smaller batch or {option('--last-batch', 'pad')}")
    return None


def epoch_shape(samples: int, config: WorkloadConfig) -> EpochShape:
    return EpochShape(samples, config.batch_size, config.last_batch)


def require_even_split(samples: int, config: WorkloadConfig, world_size: int, own_step: bool = False) -> None:
    """Refuse (exit 2) batches the ranks cannot share (see `uneven_split`), and weighted
    shares for a workload with its own `train_step` (`own_step`), whose losses the trainer
    cannot weigh one by one."""
    shape = epoch_shape(samples, config)
    if problem := uneven_split(shape, world_size, config.named("batch_size")):
        raise UsageError(problem)
    if own_step and shape.batches and shape.weight(shape.batches - 1, world_size - 1, world_size) != 1.0:
        raise UsageError(f"--last-batch pad: the last batch of an epoch ({shape.batch_samples(shape.batches - 1)} "
                         f"samples) is shared unevenly by {world_size} processes, and a workload with its own "
                         f"train_step cannot weigh its losses by share; use --last-batch drop or refuse")


def training_steps(samples: int, config: WorkloadConfig) -> TrainingSteps:
    """The run's optimizer steps: an epoch's batches in windows of --grad-accum (the last one
    may be shorter), times --epochs, or --max-steps when given (a stream's step budget)."""
    per_epoch = -(-epoch_shape(samples, config).batches // config.grad_accum)
    return TrainingSteps(per_epoch, config.max_steps or config.epochs * per_epoch)
