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
- **A `DataLoader` (torch's, or torchdata's `StatefulDataLoader`)** returned by
  `build_dataset` is refused in one line naming the fix (`refuse_loader`): the trainer owns the
  loader, and its dataset is what to return. A `StatefulDataLoader`'s `state_dict()` restores
  its position but fast-forwards past prefetched batches (meta-pytorch/data#1520) and depends on
  its worker count; the trainer's cursor does neither.

`datasets` and `torchdata` are optional: nothing here imports them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from itertools import islice

from trainer.errors import UsageError

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


def refuse_loader(dataset, spec: str) -> None:
    """A DataLoader (torch's or torchdata's StatefulDataLoader) where a dataset belongs."""
    if not any(kind.__name__ in ("DataLoader", "StatefulDataLoader") for kind in type(dataset).__mro__):
        return
    raise UsageError(f"--workload {spec}: build_dataset returned a {type(dataset).__name__}; the trainer owns the "
                     f"loader (order, workers, prefetching and the cursor in every generation, so its state_dict "
                     f"is not needed): return its dataset (loader.dataset, map-style or a stream) and pass "
                     f"--batch-size {getattr(dataset, 'batch_size', None) or 'N'} --num-workers "
                     f"{getattr(dataset, 'num_workers', 0)}")
