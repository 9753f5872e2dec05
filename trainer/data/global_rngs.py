"""The global RNGs a dataset draws from (`random`, `np.random`, torch's CPU generator), seeded
from a sample's key and put back afterwards, at a cost a fetch can pay once per sample.

Measured on this project's 2-core VM (bench/data_bench.py, docs/library.md): keying one
sample used to cost about 150 µs, almost all of it saving and restoring the three streams and
a NumPy `SeedSequence`; a plain DataLoader fetches such a sample in 5-20 µs. Now the seed is
one BLAKE2b of the key's text, each generator is seeded by its cheapest exact call, the
fetching process's own streams are saved once a batch, and a dataset may declare which of the
three it draws from (`DRAWS`): only those are seeded, none for a dataset that draws nothing.
Seeding all three costs about 9 µs a sample, Python's `random.seed` 5 of them (its
initialisation is sequential: no cheaper exact call exists), torch's alone about 2.
"""

from __future__ import annotations

import hashlib
import operator
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import TensorDataset, get_worker_info

from trainer.errors import UsageError

DRAWS = "draws_from_global_rngs"
"""The attribute by which a dataset declares which global RNGs fetching a sample draws from:
True (the default: all three), False (none: fetched unseeded, at a DataLoader's cost) or some
of `NAMES` (a torchvision pipeline draws from torch's alone). The fingerprint records it: a
resume that changes it would change every sample a drawing dataset gets."""

NAMES = ("random", "numpy", "torch")

DRAWS_NOTHING = (TensorDataset,)
"""Datasets known to draw nothing without saying so (their exact type: a subclass may add
augmentation): rows of tensors, the plain loop's habit."""


def key_seed(seed: int, epoch: int, index: int, *purpose: int) -> int:
    """A 64-bit seed that is a pure function of the key: one BLAKE2b of its text (about 1 µs,
    against 8 µs for a NumPy `SeedSequence`; integers of any size, negative seeds too)."""
    text = f"{seed} {epoch} {index} {purpose}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def seed_numpy(words: int) -> None:
    """NumPy's legacy seeding from 32 bits (an integer; an array of words costs 4x more)."""
    np.random.seed(words >> 32)


SEED = {"random": random.seed, "numpy": seed_numpy, "torch": torch.default_generator.manual_seed}
"""Each generator's cheapest exact seeding: torch's through its CPU generator
(`torch.manual_seed` also seeds every accelerator's, 100x the cost, and would disturb the
main process's GPU dropout: a dataset runs on the CPU)."""
SAVE = {"random": random.getstate, "numpy": np.random.get_state, "torch": torch.default_generator.get_state}
RESTORE = {"random": random.setstate, "numpy": np.random.set_state, "torch": torch.default_generator.set_state}
SAME = {"random": operator.eq, "numpy": lambda a, b: np.array_equal(a[1], b[1]) and a[2:] == b[2:],
        "torch": torch.equal}


@dataclass(frozen=True)
class GlobalRngs:
    """Some of the global RNGs (`NAMES`), keyed and kept together."""

    names: tuple[str, ...] = NAMES

    def seed(self, seed: int, epoch: int, index: int, *purpose: int) -> None:
        """Each of them seeded from the key (seed, epoch, index, purpose)."""
        words = key_seed(seed, epoch, index, *purpose)
        for name in self.names:
            SEED[name](words)

    @contextmanager
    def kept(self) -> Iterator[None]:
        """The fetching process's own streams put back afterwards, in the main process only:
        a DataLoader worker's serve nothing but the next fetch, which reseeds them. Saving
        NumPy's state is most of the cost (about 70 µs): a batch pays it once, not each sample."""
        if not self.names or get_worker_info() is not None:
            yield
            return
        saved = [(name, SAVE[name]()) for name in self.names]
        try:
            yield
        finally:
            for name, state in saved:
                RESTORE[name](state)

    @classmethod
    def declared(cls, dataset) -> GlobalRngs:
        """The RNGs `dataset` declares it draws from (`DRAWS`); a declaration that names
        something else is refused in one line."""
        declared = getattr(dataset, DRAWS, type(dataset) not in DRAWS_NOTHING)
        if declared is True or declared is False:
            return cls(NAMES if declared else ())
        names = (declared,) if isinstance(declared, str) else declared
        try:
            chosen = set(names)
        except TypeError:
            chosen = {declared}
        if not chosen <= set(NAMES):
            raise UsageError(f"{type(dataset).__name__}.{DRAWS} = {declared!r}: declare True (the default), False "
                             f"(draws nothing) or some of {', '.join(map(repr, NAMES))}")
        return cls(tuple(name for name in NAMES if name in chosen))

    def undeclared_draws(self, fetch: Callable[[], object]) -> list[str]:
        """The global RNGs outside these that `fetch()` drew from (each put back): a
        declaration checked on one sample before a run trusts it."""
        others = [name for name in NAMES if name not in self.names]
        before = [(name, SAVE[name]()) for name in others]
        fetch()
        moved = [name for name, state in before if not SAME[name](state, SAVE[name]())]
        for name, state in before:
            RESTORE[name](state)
        return moved

    def declaration(self) -> str:
        """What the fingerprint's `dataset` adds: nothing for the default (all three)."""
        return "" if self.names == NAMES else f"; {DRAWS}={list(self.names)}"


@contextmanager
def seeded_globals(seed: int, epoch: int, index: int, *purpose: int) -> Iterator[None]:
    """All three global RNGs seeded from the key for the duration, the fetching process's own
    streams kept: for a collate or a stream's block, once a batch."""
    rngs = GlobalRngs()
    with rngs.kept():
        rngs.seed(seed, epoch, index, *purpose)
        yield
