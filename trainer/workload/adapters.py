"""Adapters for data where users already are, and what each can make exact.

- **Hugging Face `datasets.IterableDataset`** → `HFStream`, the streaming protocol
  (trainer/workload/protocol.py `Stream`): its shards (`num_shards`, each one
  `dataset.shard(num_shards, index)`), read from an offset with `skip(offset)` (through
  `iter(batch_size=1)`, which does not split itself across DataLoader workers). Exact: the
  trainer owns the shard order, the shuffle buffer, the split and the cursor, so its own
  `state_dict()` is not needed. Its buffered `shuffle(buffer_size=…)` cannot be made exact (the
  buffer's contents are not in its state: datasets#7444) and is refused in one line; the trainer
  shuffles instead (`--shuffle-buffer`). Record counts per shard come from the caller or from
  one counting pass at start (a full read: give them when the data is large).
- **A `DataLoader`, or torchdata's `StatefulDataLoader`**, returned by `build_dataset` as it
  is (`from_loader`): the trainer adopts it. Returning the loader, rather than wrapping it
  (a `FromLoader(loader)` marker would add nothing) or taking it apart into flags, is the form
  a user's code already has; everything the trainer needs is in the loader's public
  attributes, and which settings win is decided by the flags the command line gave
  (`WorkloadConfig.given`).
  - Taken: `loader.dataset` (map-style, or a stream: `Stream`; the sample randomness is keyed
    as for any dataset); `batch_size` (fingerprinted as `config.batch_size`: the global batch
    across ranks, as `--batch-size` is, not per process as in DDP code, so a world-size change
    keeps it; an explicit `--batch-size` that disagrees is refused naming both); `num_workers`
    (not fingerprinted; an explicit `--num-workers` wins, since workers do not change what is
    trained, and a resume with another count is exact); a `collate_fn` other than torch's
    default (run with the global RNGs keyed by the batch's first position, so a random
    collator is exact too).
  - Replaced: its sampler by the trainer's keyed order, and its `state_dict()` by the
    trainer's cursor in every generation. The loader's state is not used: it is valid only for
    the worker count that saved it, and its fast-forward drops prefetched batches
    (meta-pytorch/data#1520).
  - Refused, one line each (exit 2): a loader over an `IterableDataset` that is not a stream
    (implement `shards()` and `read(shard, offset)`) or over a bare HF iterable (build it over
    `HFStream(dataset)`); a `sampler` or `batch_sampler` (or `batch_size=None`); map-style data
    read in order (`shuffle=False`: the trainer always permutes by (seed, epoch)); a
    RandomSampler with replacement or `num_samples`; `drop_last=True`; a `generator` (the
    order is drawn from `--seed`); a `worker_init_fn` (the trainer starts its own workers);
    a `collate_fn` over a dataset that has its own `collate`.
  - Not taken, because they change speed and never what is trained: `pin_memory`,
    `prefetch_factor`, `persistent_workers`, `timeout`, `multiprocessing_context`, `in_order`,
    `snapshot_every_n_steps`. The factory still receives the `--batch-size` flag's value (it
    runs before the dataset is built): a workload that returns a loader sizes nothing by it.

`datasets` and `torchdata` are optional: nothing here imports them.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import islice

from torch.utils.data import DataLoader, IterableDataset, default_collate

from trainer.config import WorkloadConfig
from trainer.errors import UsageError
from trainer.workload.protocol import is_stream

log = logging.getLogger("trainer")

SHUFFLED = ("BufferShuffledExamplesIterable", "ShuffledDataSourcesExamplesIterable",
            "ShuffledDataSourcesArrowExamplesIterable")
"""`datasets` iterables that shuffle (a buffer, or the shard order drawn from their own generator)."""


def is_hf_iterable(dataset) -> bool:
    return any(kind.__module__.startswith("datasets.") and kind.__name__ == "IterableDataset"
               for kind in type(dataset).__mro__)


def hf_shuffle(dataset) -> str | None:
    """The name of the shuffling iterable inside a `datasets.IterableDataset`, or None."""
    iterable = getattr(dataset, "_ex_iterable", None)
    while iterable is not None:
        if type(iterable).__name__ in SHUFFLED:
            return type(iterable).__name__
        iterable = getattr(iterable, "ex_iterable", None)
    return None


def refuse_hf_shuffle(dataset, spec: str) -> None:
    if shuffle := hf_shuffle(dataset):
        raise UsageError(f"--workload {spec}: the datasets.IterableDataset is shuffled ({shuffle}): its shuffle "
                         f"buffer is not in its state, so no resume can be exact; drop .shuffle() and pass "
                         f"--shuffle-buffer N (the trainer shuffles, deterministically, from its cursor)")


class HFStream:
    """A `datasets.IterableDataset` as a stream. `records`: each shard's record count when known
    (else counted once here, a full pass). `fingerprint`: what identifies the data (a dataset
    revision, a digest of its files); without it, the record counts and each shard's first record."""

    def __init__(self, dataset, records: Sequence[int] | None = None, fingerprint: str | None = None,
                 spec: str = "the workload"):
        refuse_hf_shuffle(dataset, spec)
        self.dataset, self.count = dataset, dataset.num_shards
        self.records = list(records) if records is not None else [
            sum(1 for _ in self.shard(index).iter(batch_size=1)) for index in range(self.count)]
        if len(self.records) != self.count:
            raise UsageError(f"--workload {spec}: HFStream got {len(self.records)} record counts for a dataset of "
                             f"{self.count} shards; give one count per shard (or none, to count them)")
        self.own_fingerprint = fingerprint

    def shard(self, index: int):
        return self.dataset.shard(num_shards=self.count, index=index)

    def shards(self) -> list[tuple[str, int]]:
        return [(f"shard-{index:05d}", records) for index, records in enumerate(self.records)]

    def read(self, shard: tuple[str, int], offset: int):
        """Through `iter(batch_size=1)`: inside a DataLoader worker, iterating an HF dataset
        splits it across the workers by itself (only its share of the shards comes), and the
        trainer has already split the samples; the batched iterator does not."""
        index = int(shard[0].removeprefix("shard-"))
        rows = self.shard(index).skip(offset) if offset else self.shard(index)
        for batch in rows.iter(batch_size=1):
            yield {key: value[0] for key, value in batch.items()}

    def fingerprint(self) -> str:
        if self.own_fingerprint is not None:
            return self.own_fingerprint
        digest = hashlib.sha256(repr(self.records).encode())
        for index in range(self.count):
            digest.update(repr(next(islice(self.read(self.shards()[index], 0), 1), None)).encode())
        return f"hf-stream:{digest.hexdigest()}"


@dataclass(frozen=True)
class AdoptedLoader:
    """What the trainer takes from a DataLoader returned by `build_dataset` (`from_loader`)."""

    dataset: object
    """`loader.dataset`: map-style, or a stream (`trainer.workload.protocol.Stream`)."""
    collate: Callable | None
    """The loader's `collate_fn` when it is not torch's default (run under the keyed RNGs)."""
    config: WorkloadConfig
    """The configuration with the loader's batch size, and its workers unless --num-workers is given
    (`loader_settings` names which came from the loader)."""


def is_loader(dataset) -> bool:
    """A torch DataLoader, or a subclass (torchdata's StatefulDataLoader is one)."""
    return isinstance(dataset, DataLoader)


def from_loader(loader: DataLoader, config: WorkloadConfig, spec: str) -> AdoptedLoader:
    """Adopt a DataLoader: its dataset, its `batch_size` (an explicit --batch-size that
    disagrees is refused), its `num_workers` (unless --num-workers is given: workers do not
    change what is trained, so the flag wins and says so) and its `collate_fn`. Every setting
    that would make the trainer's order differ from the loader's is refused in one line."""
    named = f"--workload {spec}: build_dataset returned a {type(loader).__name__}"
    dataset = loader.dataset
    if is_hf_iterable(dataset):
        raise UsageError(f"{named} over a datasets.IterableDataset, whose own state_dict() resumes only at the same "
                         f"worker count: build the loader over trainer.workload.adapters.HFStream(dataset) (the "
                         f"trainer then owns its order, shuffle buffer and cursor)")
    streamed = is_stream(dataset)
    if isinstance(dataset, IterableDataset) and not streamed:
        raise UsageError(f"{named} over a {type(dataset).__name__}, an IterableDataset no resume can make exact "
                         f"(the loader's state_dict() depends on the worker count and drops prefetched batches "
                         f"on fast-forward, meta-pytorch/data#1520): give the dataset shards() and read(shard, "
                         f"offset) (the streaming protocol, trainer/workload/protocol.py Stream; HFStream(dataset) "
                         f"for Hugging Face data)")
    if problem := loader_problem(loader, streamed):
        raise UsageError(f"{named} with {problem}")
    collate = None if loader.collate_fn is default_collate else loader.collate_fn
    if collate is not None and callable(getattr(dataset, "collate", None)):
        raise UsageError(f"{named} with a collate_fn, over a dataset with its own collate(): one of the two would "
                         f"be ignored; keep one")
    if "batch_size" in config.given and config.batch_size != loader.batch_size:
        raise UsageError(f"{named} with batch_size={loader.batch_size}, but --batch-size {config.batch_size} was "
                         f"given: drop --batch-size (the loader's is adopted) or make the two equal")
    workers, said = loader.num_workers, f"num_workers={loader.num_workers}"
    settings = {"batch_size", "num_workers"} - config.given  # given equal to the loader's, the flag is named
    if "num_workers" in config.given:
        if config.num_workers != workers:
            said = f"--num-workers {config.num_workers} instead of its num_workers={workers} (workers do not " \
                   f"change what is trained)"
        workers = config.num_workers
    log.info("adopted the %s: batch_size=%d (the global batch, split across processes under torchrun), %s, "
             "collate_fn=%s; the trainer's order and cursor replace its sampler and state_dict()",
             type(loader).__name__, loader.batch_size, said,
             getattr(collate, "__name__", type(collate).__name__) if collate is not None else "default")
    return AdoptedLoader(dataset, collate, replace(config, batch_size=loader.batch_size, num_workers=workers,
                                                   loader_settings=frozenset(settings)))


RANDOM_SAMPLERS = ("torch.utils.data.sampler", "torchdata.stateful_dataloader.sampler")
"""Where a loader's default RandomSampler (`shuffle=True`) comes from: torch, or torchdata."""


def loader_problem(loader: DataLoader, streamed: bool) -> str | None:
    """What in a DataLoader the trainer cannot honour exactly, as "the setting: why; the fix",
    or None. The trainer's order replaces the loader's sampler, so only the default one (a
    plain shuffle, or a stream's) is accepted."""
    sampler, kind = loader.sampler, type(loader.sampler)
    if loader.batch_size is None:
        return ("a batch_sampler (or batch_size=None): the trainer batches by --batch-size in its own seeded "
                "order; give the loader batch_size=N and no batch_sampler")
    if loader.drop_last:
        return ("drop_last=True: the trainer decides an epoch's last, smaller batch (--last-batch pad, drop or "
                "refuse); drop drop_last and pass --last-batch drop")
    if loader.generator is not None or (kind.__module__ == RANDOM_SAMPLERS[0] and getattr(sampler, "generator", None)
                                        is not None):
        return ("a generator: the trainer draws the order and every sample's randomness from --seed and the epoch "
                "(so a resume draws them again); drop generator= and set --seed")
    if loader.worker_init_fn is not None:
        return ("a worker_init_fn, which the trainer's workers (their number may change between attempts) would "
                "not run; open resources lazily in the dataset instead")
    if streamed:
        if kind.__name__ in ("_InfiniteConstantSampler", "SequentialSampler"):
            return None
        return f"sampler={kind.__name__}: a stream's order is the trainer's (--shuffle-buffer); drop sampler="
    if kind.__name__ == "SequentialSampler":
        return ("shuffle=False: the trainer reads map-style data in a permutation drawn from (--seed, epoch), not "
                "in index order; pass shuffle=True")
    if kind.__name__ != "RandomSampler" or kind.__module__ not in RANDOM_SAMPLERS:
        return (f"sampler={kind.__name__}: the trainer's seeded order (split across ranks by itself) replaces a "
                f"sampler; drop sampler= and pass shuffle=True")
    if sampler.replacement or sampler._num_samples is not None:
        return ("a RandomSampler with replacement or num_samples: the trainer draws every sample once an epoch; "
                "pass shuffle=True")
    return None
