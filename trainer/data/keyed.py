"""The data half of an exact resume in a user's own loop: the trainer's keyed order.

A loop that shuffles with its own DataLoader draws the order from the global RNG (a resume
starts a new shuffle, so a mid-epoch resume trains some samples twice and others never) and
fetches with RNG streams that depend on which worker fetched what. `KeyedData` hands the
loop the trainer's own order instead (`trainer/data/order.py`, `trainer/data/stream.py`):
a permutation that is a pure function of (seed, epoch), every sample fetched under RNGs
keyed by (seed, epoch, index), any number of workers. Its position is the run's progress
(epoch, batches done in it), which every generation stores, so a resume continues inside the
epoch at the next batch. A stream (`shards()` and `read(shard, offset)`) gets its cursor
saved too, as the trainer's does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from trainer.config import WorkloadConfig
from trainer.data.order import EpochShape, Fetched, epoch_shape
from trainer.data.source import DataSource, cursors, source_of


@dataclass(frozen=True)
class KeyedData:
    """A map-style dataset (`__len__`, `__getitem__`) or a stream, to be read in the trainer's
    keyed order through `RecoveryRun.batches()`. `batch_size`, `seed` and `shuffle_buffer`
    shape the order and are fingerprinted; `num_workers` does not change a bit."""

    dataset: object
    batch_size: int = WorkloadConfig.batch_size
    seed: int = WorkloadConfig.seed
    num_workers: int = WorkloadConfig.num_workers
    collate_fn: Callable | None = None
    """Run under RNGs keyed by (seed, epoch, the batch's first index), so a random collator
    (MLM masking) draws the same numbers wherever a resume starts."""
    shuffle_buffer: int = WorkloadConfig.shuffle_buffer
    """Streams only: records per shuffle block (see `WorkloadConfig.shuffle_buffer`)."""
    last_batch: str = WorkloadConfig.last_batch
    """pad | drop | refuse: an epoch's ragged last batch, as `--last-batch` (trainer/run/
    batching.py): `pad` trains it (under torchrun each rank's loss weighted by its share:
    `RecoveryRun.weight`), `drop` leaves it out (the ledger counts it), `refuse` stops a run
    whose processes cannot share it evenly."""
    stream_lanes: int | None = WorkloadConfig.stream_lanes
    """Streams only: the lanes the stream is cut into, fixed for the run (`--stream-lanes`;
    None: the world size the run starts with). One order at every world size that divides
    them, each record read once an epoch; fingerprinted once given (trainer/data/stream.py)."""
    grad_accum: int = WorkloadConfig.grad_accum
    """Micro-batches per optimizer step (`--grad-accum`): `batch_size` is then a micro-batch's.
    The progress counts optimizer steps and the micro-batches done in the epoch; an epoch's
    last window may be shorter (windows never span epochs)."""
    source: DataSource = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", source_of(self.dataset, self.settings(), "KeyedData", self.collate_fn))

    def settings(self) -> WorkloadConfig:
        """The trainer's options this order is made of (what the fingerprint's `config` holds)."""
        return WorkloadConfig(batch_size=self.batch_size, seed=self.seed, num_workers=self.num_workers,
                              shuffle_buffer=self.shuffle_buffer, last_batch=self.last_batch,
                              grad_accum=self.grad_accum, stream_lanes=self.stream_lanes,
                              workload="your own loop")

    @property
    def shape(self) -> EpochShape:
        """An epoch's global batches (`batch_size` samples each; the last one by `last_batch`)."""
        return epoch_shape(len(self.source), self.settings())

    @property
    def batches_per_epoch(self) -> int:
        return self.shape.batches

    def cursors(self, world_size: int = 1) -> dict:
        """What a generation stores of the position beyond the progress (a stream's cursor)."""
        return cursors(self.source, self.shape, world_size)

    def shares(self, epoch: int, start_batch: int, rank: int = 0, world_size: int = 1) -> Iterator[Fetched]:
        """This rank's share of every global batch of `epoch` from `start_batch` (`Fetched`:
        its sample ids, the batch, its loss weight), as the trainer's own loop reads it."""
        return self.source.loader(self.shape, epoch, start_batch, rank, world_size, self.num_workers)

    def epoch_batches(self, epoch: int, start_batch: int, rank: int = 0, world_size: int = 1):
        """(sample ids, batch) of this rank for the rest of `epoch`, from `start_batch`."""
        for fetched in self.shares(epoch, start_batch, rank, world_size):
            yield fetched.ids, fetched.batch


@dataclass(frozen=True)
class UnkeyedData:
    """What a run knows of a loop that reads its own data: nothing (no samples, no order, not
    fingerprinted), but whose order it is (`report` says it). Its resume is exact only where
    the loop restores its own position. No samples: false, as an empty dataset is."""

    order: str = "your own loop's data order is its own (read it through recovery.KeyedData to have it tracked)"

    def __len__(self) -> int:
        return 0

    def fingerprint(self) -> str:
        return f"{self.order}; not fingerprinted, not in the sample ledger"
