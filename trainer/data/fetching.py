"""Fetching samples: randomness a dataset draws from the global RNGs becomes a pure function
of (seed, epoch, index), whichever process fetches the sample; and batches of any structure
reach the device.

Users bring the torchvision habit: augmentation that calls `random`, `np.random` or
`torch.rand*` inside `__getitem__`. Left alone, those draws depend on which DataLoader worker
fetched the sample (workers are seeded per iterator, not per sample) and, with no workers,
on how far the main process's streams have advanced, so `--num-workers` and the resume point
would change training. Here every fetch runs with the global RNGs seeded from
(seed, epoch, index) (those the dataset declares it draws from: trainer/data/global_rngs.py),
and the fetching process's own streams are put back after each batch: with
`--num-workers 0` the main process's dropout, noise and shuffling draws are exactly what they
would be had the dataset drawn nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from trainer.config import WorkloadConfig
from trainer.data.global_rngs import DRAWS, NAMES, GlobalRngs, seeded_globals
from trainer.data.order import EpochBatchOrder, EpochShape, Fetched
from trainer.data.workers import WorkerSignals
from trainer.errors import UsageError, option
from trainer.workload import dataset_fingerprint


COLLATE = 1
"""The `purpose` of a collate's seeds, apart from every sample's."""


class KeyedSeeding(Dataset):
    """The workload's dataset, fetched by (epoch, index) keys, each sample under the global
    RNGs seeded from its key (trainer/data/global_rngs.py): `dataset.sample_at(epoch, index)`
    when it has one, else `dataset[index]`. A batch is fetched at once (`__getitems__`, which a
    DataLoader calls in its worker or in this process): the fetching process's own streams are
    saved and put back once a batch. Only the RNGs the dataset declares it draws from are
    seeded (`DRAWS`; all three unless it says); one that draws nothing is fetched at a
    DataLoader's cost. With a `collate` (a DataLoader's `collate_fn`, adopted)
    or a `dataset.collate(samples)`, each sample travels with its key to `KeyedCollate`."""

    def __init__(self, dataset, seed: int, collate=None):
        self.dataset = dataset
        self.seed = seed
        self.keyed = callable(getattr(dataset, "sample_at", None))
        self.collate = collate or getattr(dataset, "collate", None)
        self.rngs = GlobalRngs.declared(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        if not self.rngs.names:
            return [self.fetched(key) for key in keys]
        samples = []
        with self.rngs.kept():
            for key in keys:
                self.rngs.seed(self.seed, *key)
                samples.append(self.fetched(key))
        return samples

    def fetched(self, key: tuple[int, int]):
        epoch, index = key
        sample = self.dataset.sample_at(epoch, index) if self.keyed else self.dataset[index]
        return (key, sample) if self.collate is not None else sample

    def loader(self, shape: EpochShape, epoch: int, start_batch: int, rank: int, world_size: int,
               num_workers: int) -> Iterator[Fetched]:
        """This rank's micro-batches for the rest of the epoch, in order; the same interface
        as a stream's (`trainer.data.stream.StreamSource`)."""
        order = EpochBatchOrder(shape, self.seed, epoch, start_batch, rank, world_size)
        for (keys, weight), batch in zip(order.weighted(), epoch_loader(self, order, num_workers)):
            yield Fetched(torch.tensor([index for _, index in keys], dtype=torch.int64), batch, weight)

    def fingerprint(self) -> str:
        """The dataset's, and which global RNGs it declares it draws from (`DRAWS`, when not
        all three): a declaration changed on resume would change every drawing sample."""
        return dataset_fingerprint(self.dataset) + self.rngs.declaration()

    def probe(self) -> None:
        """Fetch one sample here, in the main process (see `refuse_state_moved_by_fetching`)."""
        self[(0, 0)]


class KeyedCollate:
    """A workload's `collate` run with the global RNGs seeded from (seed, epoch, the batch's
    first index): a random collator (MLM masking) draws the same numbers whichever process
    collates and wherever a resume starts, as a sample's augmentation does."""

    def __init__(self, collate, seed: int):
        self.collate, self.seed = collate, seed

    def __call__(self, keyed: list):
        (epoch, first), _ = keyed[0]
        with seeded_globals(self.seed, epoch, first, COLLATE):
            return self.collate([sample for _, sample in keyed])


def epoch_loader(dataset: KeyedSeeding, order: EpochBatchOrder, num_workers: int) -> DataLoader:
    """The batches `order` names, fetched by `num_workers` processes (0: this one).
    A private generator keeps the DataLoader from drawing on the global torch RNG (it seeds
    workers from it on every new iterator, which a resume would repeat); worker seeds do not
    reach the samples, `KeyedSeeding` reseeds every fetch."""
    return DataLoader(dataset, batch_sampler=order, num_workers=num_workers,
                      collate_fn=KeyedCollate(dataset.collate, dataset.seed) if dataset.collate else None,
                      generator=torch.Generator().manual_seed(0), worker_init_fn=WorkerSignals(os.getpid()))


def to_device(batch, device: torch.device):
    """A batch of any structure with every tensor on `device`: tensors, and tuples
    (named ones too), lists, dicts and dataclasses of them, nested; other values as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, Mapping):
        return type(batch)({key: to_device(value, device) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def refuse_state_moved_by_fetching(extras: dict, dataset: KeyedSeeding, config: WorkloadConfig, spec: str) -> None:
    """Refuse, before the first step, a workload whose `stateful()` object moves when a sample
    is fetched (a stream's cursor kept by a map-style dataset that ignores its index) while
    DataLoader workers fetch: each worker moves its own copy, the generation saves the main
    process's, which never moves, and the run would train on other data than with
    `--num-workers 0`, silently. The probe fetches one sample here, compares every extra's
    state before and after, and puts the state back (the RNGs are put back by the fetch). The
    line names where the worker count came from: --num-workers, or an adopted DataLoader's
    num_workers (`WorkloadConfig.named`)."""
    if config.num_workers == 0 or not extras or len(dataset) == 0:
        return
    before = {name: copy.deepcopy(kept.state_dict()) for name, kept in extras.items()}
    dataset.probe()
    moved = [name for name, kept in extras.items() if not same_state(before[name], kept.state_dict())]
    for name in moved:
        extras[name].load_state_dict(before[name])
    if moved:
        raise UsageError(f"{option('--workload', spec)}: its stateful() {moved[0]!r} changes when a sample is fetched; with "
                         f"{config.named('num_workers')} that happens in the workers' copies, which no generation "
                         f"saves, so the run would train on other data than with {option('--num-workers', 0)}: fetch "
                         f"by index, or give shards() and read(shard, offset) (the streaming protocol: the trainer "
                         f"owns the order and the cursor), or run with {option('--num-workers', 0)}")


def refuse_undeclared_draws(dataset: KeyedSeeding, spec: str) -> None:
    """Refuse, before the first step, a dataset that declares the global RNGs it draws from
    (`DRAWS`) and draws from another when a sample is fetched: those draws would go unkeyed,
    changing with the worker count and the resume point, silently. One sample is fetched
    here (a draw only some samples make goes unseen); datasets that declare nothing are
    keyed on all three and not probed."""
    if len(dataset) == 0 or dataset.rngs.names == NAMES:
        return
    if moved := dataset.rngs.undeclared_draws(dataset.probe):
        declared = getattr(dataset.dataset, DRAWS, "False (it is a TensorDataset)")
        names = [name for name in NAMES if name in moved or name in dataset.rngs.names]
        raise UsageError(f"{spec}: fetching a sample of {type(dataset.dataset).__name__} drew from {moved[0]}'s "
                         f"global RNG, which its {DRAWS} = {declared!r} leaves out, so its draws would change with "
                         f"the worker count and the resume point: declare {DRAWS} = {tuple(names)!r}, or leave it "
                         f"out (all three are then keyed)")


def same_state(a, b) -> bool:
    """Equal state dicts, tensors compared bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_state(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
