"""Global-RNG augmentation inside a dataset is a pure function of (seed, epoch, index): the
same for any number of DataLoader workers and any resume position, different across epochs,
and fetching in the main process leaves its own RNG streams where they were."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.data.order import EpochBatchOrder, EpochShape
from trainer.data.fetching import KeyedSeeding, epoch_loader
from trainer.run.state import capture_rng

SAMPLES, BATCH, SEED = 12, 4, 7


class GlobalRngAugmentation(Dataset):
    """The torchvision habit: augmentation that draws from all three global RNGs."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return torch.tensor([float(index), torch.rand(()).item(), np.random.rand(), random.random()],
                            dtype=torch.float64)


def epoch(number: int, num_workers: int, position: int = 0) -> list[torch.Tensor]:
    order = EpochBatchOrder(EpochShape(SAMPLES, BATCH), SEED, number, position)
    return list(epoch_loader(KeyedSeeding(GlobalRngAugmentation(), SEED), order, num_workers))


def test_worker_count_does_not_change_the_samples():
    in_process = epoch(0, num_workers=0)
    assert all(torch.equal(a, b) for a, b in zip(in_process, epoch(0, num_workers=2), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(in_process, epoch(0, num_workers=1), strict=True))


def test_every_epoch_draws_different_randomness_for_the_same_sample():
    by_index = [{int(row[0]): row[1:] for batch in epoch(number, num_workers=2) for row in batch}
                for number in (0, 1)]
    assert all(not torch.equal(by_index[0][i], by_index[1][i]) for i in range(SAMPLES))


def test_a_mid_epoch_resume_fetches_the_rest_of_the_epoch_unchanged():
    whole = epoch(1, num_workers=0)
    resumed = epoch(1, num_workers=2, position=2)
    assert all(torch.equal(a, b) for a, b in zip(whole[2:], resumed, strict=True))


def test_fetching_in_process_leaves_the_main_rng_streams_alone():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    before = capture_rng()
    epoch(0, num_workers=0)
    after = capture_rng()
    assert torch.equal(before["torch"], after["torch"])
    assert torch.equal(before["python"]["internal"], after["python"]["internal"])
    assert torch.equal(before["numpy"]["keys"], after["numpy"]["keys"])
    assert before["numpy"]["pos"] == after["numpy"]["pos"]


def test_batches_of_any_structure_reach_the_device():
    from collections import namedtuple
    from dataclasses import dataclass

    from trainer.data.fetching import to_device

    @dataclass
    class Pair:
        image: torch.Tensor
        tags: list

    Named = namedtuple("Named", "a b")
    meta = torch.device("meta")  # a device every build has: proves the move without a GPU
    batch = {"pair": Pair(torch.ones(2), [torch.zeros(1), "label"]), "named": Named(torch.ones(1), 3),
             "tuple": (torch.ones(1),)}
    moved = to_device(batch, meta)
    assert moved["pair"].image.device == meta and moved["pair"].tags[0].device == meta
    assert moved["pair"].tags[1] == "label" and isinstance(moved["pair"], Pair)
    assert isinstance(moved["named"], Named) and moved["named"].a.device == meta and moved["named"].b == 3
    assert moved["tuple"][0].device == meta and batch["pair"].image.device.type == "cpu"


def test_a_datasets_own_collate_builds_the_batch():
    from dataclasses import dataclass

    @dataclass
    class Batch:
        values: torch.Tensor

    class WithCollate(GlobalRngAugmentation):
        @staticmethod
        def collate(samples):
            return Batch(torch.stack(samples))

    order = EpochBatchOrder(EpochShape(SAMPLES, BATCH), SEED, 0, 0)
    batches = list(epoch_loader(KeyedSeeding(WithCollate(), SEED), order, 0))
    assert all(isinstance(b, Batch) and b.values.shape == (BATCH, 4) for b in batches)
    assert all(torch.equal(a, b.values) for a, b in zip(epoch(0, num_workers=0), batches, strict=True))
