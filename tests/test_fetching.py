"""Global-RNG augmentation inside a dataset is a pure function of (seed, epoch, index): the
same for any number of DataLoader workers and any resume position, different across epochs,
and fetching in the main process leaves its own RNG streams where they were."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from trainer.data.order import EpochBatchOrder, EpochShape
from trainer.data.fetching import KeyedSeeding, epoch_loader
from trainer.errors import UsageError
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


class TorchOnlyAugmentation(GlobalRngAugmentation):
    """A torchvision pipeline: it draws from torch's global RNG alone, and says so."""

    draws_from_global_rngs = ("torch",)

    def __getitem__(self, index: int):
        return torch.tensor([float(index), torch.rand(()).item()], dtype=torch.float64)


def keyed_epoch(dataset, number: int, num_workers: int, position: int = 0) -> list[torch.Tensor]:
    order = EpochBatchOrder(EpochShape(SAMPLES, BATCH), SEED, number, position)
    return list(epoch_loader(KeyedSeeding(dataset, SEED), order, num_workers))


def test_a_dataset_that_names_the_rngs_it_draws_from_gets_them_keyed_at_any_worker_count():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    whole = keyed_epoch(TorchOnlyAugmentation(), 0, num_workers=0)
    assert torch.equal(before, torch.get_rng_state())  # the loop's own stream put back
    for workers in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(whole, keyed_epoch(TorchOnlyAugmentation(), 0, workers),
                                                     strict=True))
    resumed = keyed_epoch(TorchOnlyAugmentation(), 0, num_workers=2, position=1)
    assert all(torch.equal(a, b) for a, b in zip(whole[1:], resumed, strict=True))
    assert len({round(row[1].item(), 12) for batch in whole for row in batch}) == SAMPLES


def test_a_dataset_that_declares_it_draws_nothing_is_fetched_unseeded():
    """The declaration is taken at its word (no seeding, no saving: a DataLoader's cost), so a
    dataset that declares False and draws anyway reads the loop's own stream."""

    class Undeclared(TorchOnlyAugmentation):
        draws_from_global_rngs = False

    torch.manual_seed(5)
    fetched = torch.cat(keyed_epoch(Undeclared(), 0, num_workers=0))
    torch.manual_seed(5)
    expected = [torch.rand(()).item() for _ in range(SAMPLES)]
    assert fetched[:, 1].tolist() == expected


def test_the_fingerprint_records_a_declaration_and_a_wrong_one_is_refused():
    assert KeyedSeeding(GlobalRngAugmentation(), SEED).fingerprint().endswith(":len=12")  # the default: unchanged
    assert KeyedSeeding(TorchOnlyAugmentation(), SEED).fingerprint().endswith("; draws_from_global_rngs=['torch']")

    class Nothing(GlobalRngAugmentation):
        draws_from_global_rngs = False

    assert KeyedSeeding(Nothing(), SEED).fingerprint().endswith("; draws_from_global_rngs=[]")
    rows = torch.utils.data.TensorDataset(torch.zeros(SAMPLES, 2))  # known to draw nothing
    assert KeyedSeeding(rows, SEED).fingerprint().endswith("; draws_from_global_rngs=[]")

    class Misspelt(GlobalRngAugmentation):
        draws_from_global_rngs = ("torch", "np")

    with pytest.raises(UsageError, match="Misspelt.draws_from_global_rngs = .*some of 'random', 'numpy', 'torch'"):
        KeyedSeeding(Misspelt(), SEED)


def test_a_dataset_that_draws_from_an_rng_it_does_not_declare_is_refused_before_the_run():
    from trainer.data.keyed import KeyedData  # the data layer's refusal (recovery.KeyedData says it and exits 2)

    class Lying(GlobalRngAugmentation):
        draws_from_global_rngs = ("torch",)  # and numpy's and Python's too

    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    before = capture_rng()
    with pytest.raises(UsageError, match=r"drew from random's global RNG, which its draws_from_global_rngs = "
                                         r"\('torch',\) leaves out.*declare draws_from_global_rngs = "
                                         r"\('random', 'numpy', 'torch'\)"):
        KeyedData(Lying(), batch_size=BATCH)
    after = capture_rng()  # the probe put every stream back
    assert torch.equal(before["numpy"]["keys"], after["numpy"]["keys"]) and torch.equal(before["torch"], after["torch"])
    assert torch.equal(before["python"]["internal"], after["python"]["internal"])
    assert len(KeyedData(TorchOnlyAugmentation(), batch_size=BATCH).source) == SAMPLES  # a true one passes
