"""Streaming data with a cursor the trainer owns.

A streaming workload gives shards (name and record count) and a reader of one shard's
records from an offset (`trainer.workload.protocol.Stream`). The trainer decides everything
that makes a resume exact, the way `batching.py` does for a map-style dataset:

- **The global sample order**, a pure function of (seed, epoch): the shards in an order
  drawn from (seed, epoch), read one after another as one stream, shuffled in blocks of
  `--shuffle-buffer` records, each block by a permutation drawn from (seed, epoch, block).
  The buffer is the block: it is never saved, because it is a pure function of the cursor;
  a resume re-reads the block the cursor is in (at most `--shuffle-buffer` records).
- **The cursor**: samples consumed in the epoch, global (counted over every rank). It is
  saved in every generation (`stream` in the state, checked against the progress on restore),
  and it does not depend on the number of processes or workers.
- **The split, by global sample index**: global batch b holds positions
  [b·batch, (b+1)·batch); rank r takes every world-size-th of them from r, as map-style
  batches are split. Worker w of a rank's DataLoader builds that rank's batches w, w+W, …,
  which the DataLoader hands out in turn, so every worker count gives the same batches in
  the same order, and every world size the same global order (MosaicML streaming's
  definition of elastic).

What it costs: each DataLoader worker (and each rank) reads every block that holds one of its
samples, which with a buffer larger than a batch is every block: reading is parallel, but its
volume grows with workers × ranks (`bench/stream_bench.py` measures the step time against a
plain DataLoader). Sample ids, for the ledger, number the records in the declared shard order.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import islice
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from trainer.config import RunConfig, WorkloadConfig
from trainer.errors import CorruptGeneration, UsageError
from trainer.run.fetching import COLLATE, KeyedSeeding, seeded_globals
from trainer.run.runtime import WorkerSignals
from trainer.workload.adapters import from_loader, is_hf_iterable, is_loader, refuse_hf_shuffle
from trainer.workload.protocol import is_stream

READ = 2
"""The `purpose` of the seeds a block's read runs under, apart from samples' and collates'."""


@dataclass(frozen=True)
class Shard:
    """One shard as the trainer sees it: the workload's own handle, its name and its records."""

    handle: object
    name: str
    records: int


def shards_of(stream, spec: str) -> tuple[Shard, ...]:
    """The stream's shards, checked: `shards()` gives (name, records) pairs or objects with
    `name` and `records`; refused in one line (exit 2) otherwise."""
    found = []
    for shard in stream.shards():
        if isinstance(shard, tuple) and len(shard) == 2:
            name, records = shard
        else:
            name, records = getattr(shard, "name", None), getattr(shard, "records", None)
        if not isinstance(name, str) or not isinstance(records, int) or isinstance(records, bool) or records < 0:
            raise UsageError(f"--workload {spec}: shards() gave {shard!r}; give (name, records) pairs or objects "
                             f"with a str `name` and an int `records` >= 0 (the trainer numbers samples by them)")
        found.append(Shard(shard, name, records))
    if not found or sum(shard.records for shard in found) == 0:
        raise UsageError(f"--workload {spec}: shards() gave no records; a stream needs at least one record")
    if len({shard.name for shard in found}) != len(found):
        raise UsageError(f"--workload {spec}: shards() gave two shards of one name; names must be unique")
    return tuple(found)


class StreamOrder:
    """The global order of one epoch: which sample id sits at each global position, and
    where in the shards the block holding it starts. Pure: (records per shard, seed, epoch,
    buffer) decide it."""

    def __init__(self, records: Sequence[int], seed: int, epoch: int, buffer: int):
        self.records, self.seed, self.epoch, self.buffer = tuple(records), seed, epoch, buffer
        self.samples = sum(self.records)
        self.first_id = np.concatenate([[0], np.cumsum(self.records)])[:-1]
        """The id of each shard's first record (ids follow the declared shard order)."""
        self.shard_order = np.random.default_rng([seed, epoch, 0x5A]).permutation(len(self.records))
        ordered = [self.records[shard] for shard in self.shard_order]
        self.stream_start = np.concatenate([[0], np.cumsum(ordered)]).tolist()
        """Where each shard (in this epoch's order) starts in the epoch's stream."""
        self.permutations: dict[int, np.ndarray] = {}
        """The last blocks' permutations (a cache: a reader moves forward, block by block)."""

    def block_size(self, block: int) -> int:
        return min(self.buffer, self.samples - block * self.buffer)

    def block_permutation(self, block: int) -> np.ndarray:
        if block not in self.permutations:
            if len(self.permutations) >= 4:
                del self.permutations[min(self.permutations)]
            self.permutations[block] = np.random.default_rng([self.seed, self.epoch, block, 0xB1]).permutation(
                self.block_size(block))
        return self.permutations[block]

    def locate(self, stream_position: int) -> tuple[int, int]:
        """(index into this epoch's shard order, offset inside that shard) of a stream position."""
        at = bisect.bisect_right(self.stream_start, stream_position) - 1
        return at, stream_position - self.stream_start[at]

    def sample_id(self, stream_position: int) -> int:
        at, offset = self.locate(stream_position)
        return int(self.first_id[self.shard_order[at]]) + offset

    def ids(self, positions: Sequence[int]) -> list[int]:
        """The sample ids at global positions of this epoch."""
        return [self.sample_id(self.stream_position(position)) for position in positions]

    def stream_position(self, position: int) -> int:
        block, inside = divmod(position, self.buffer)
        return block * self.buffer + int(self.block_permutation(block)[inside])


def rank_positions(batch: int, batch_size: int, samples: int, rank: int, world_size: int) -> range:
    """The global positions of global batch `batch` that rank `rank` trains on."""
    start = batch * batch_size
    return range(start + rank, min(start + batch_size, samples), world_size)


class StreamEpoch(IterableDataset):
    """One rank's batches of one epoch from a batch position on, as (sample ids, batch);
    under DataLoader workers each builds every W-th batch (see the module docstring)."""

    def __init__(self, source: StreamSource, order: StreamOrder, batch_size: int, start_batch: int, rank: int,
                 world_size: int):
        self.stream, self.shards, self.collate, self.order = source.stream, source.shards, source.collate, order
        self.batch_size, self.start_batch, self.rank, self.world_size = batch_size, start_batch, rank, world_size

    def batches(self) -> range:
        return range(self.start_batch, -(-self.order.samples // self.batch_size))

    def __len__(self) -> int:
        return len(self.batches())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, object]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        buffers: dict[int, list] = {}
        order = self.order
        for batch in self.batches()[worker::workers]:
            positions = rank_positions(batch, self.batch_size, order.samples, self.rank, self.world_size)
            samples = []
            for position in positions:
                block, inside = divmod(position, order.buffer)
                if block not in buffers:
                    for old in [kept for kept in buffers if kept < block]:
                        del buffers[old]  # positions only move forward: a passed block is done
                    buffers[block] = self.read_block(block)
                samples.append(buffers[block][int(order.block_permutation(block)[inside])])
            ids = torch.tensor(order.ids(positions), dtype=torch.int64)
            yield ids, self.collated(samples, positions[0])

    def read_block(self, block: int) -> list:
        """The block's records in stream order, read through the workload's `read(shard, offset)`
        (with the global RNGs keyed by the block, should the reader draw any), crossing into the
        next shards of the epoch's order as needed."""
        order = self.order
        start, wanted = block * order.buffer, order.block_size(block)
        records: list = []
        at, offset = order.locate(start)
        with seeded_globals(order.seed, order.epoch, block, READ):
            while len(records) < wanted:
                shard = self.shards[order.shard_order[at]]
                take = min(wanted - len(records), shard.records - offset)
                got = list(islice(self.stream.read(shard.handle, offset), take))
                if len(got) != take:
                    raise ValueError(f"shard {shard.name!r} gave {offset + len(got)} records, but shards() "
                                     f"declared {shard.records}")
                records.extend(got)
                at, offset = at + 1, 0
        return records

    def collated(self, samples: list, first_position: int):
        if self.collate is None:
            return default_collate(samples)
        with seeded_globals(self.order.seed, self.order.epoch, first_position, COLLATE):
            return self.collate(samples)


class StreamSource:
    """A stream bound to the trainer: its shards, checked once, and its epochs' loaders."""

    def __init__(self, stream, seed: int, buffer: int, spec: str, collate=None):
        self.stream, self.seed, self.buffer = stream, seed, buffer
        self.collate = collate or getattr(stream, "collate", None)
        """A DataLoader's `collate_fn` (adopted), else the stream's own `collate`, else None."""
        self.shards = shards_of(stream, spec)
        self.records = tuple(shard.records for shard in self.shards)

    def __len__(self) -> int:
        return sum(self.records)

    def order(self, epoch: int) -> StreamOrder:
        return StreamOrder(self.records, self.seed, epoch, self.buffer)

    def epoch(self, epoch: int, batch_size: int, start_batch: int, rank: int, world_size: int) -> StreamEpoch:
        return StreamEpoch(self, self.order(epoch), batch_size, start_batch, rank, world_size)

    def loader(self, epoch: int, batch_size: int, start_batch: int, rank: int, world_size: int,
               num_workers: int) -> Iterator[tuple[torch.Tensor, object]]:
        """(sample ids, batch) of this rank for the rest of the epoch, in order. A private
        generator keeps the DataLoader off the global torch RNG (as `fetching.epoch_loader`)."""
        return iter(DataLoader(self.epoch(epoch, batch_size, start_batch, rank, world_size), batch_size=None,
                               num_workers=num_workers, generator=torch.Generator().manual_seed(0),
                               worker_init_fn=WorkerSignals(os.getpid())))

    def fingerprint(self) -> str:
        """The stream's own `fingerprint()`, or a digest of its shards' names and record counts
        (changed records of the same count then go unnoticed)."""
        own = getattr(self.stream, "fingerprint", None)
        if own is not None:
            return own()
        digest = hashlib.sha256()
        for shard in self.shards:
            digest.update(f"{shard.name}\0{shard.records}\n".encode())
        return f"shards:{digest.hexdigest()}"

    def probe(self) -> None:
        """Read the first block here, in the main process (see
        `trainer.run.fetching.refuse_state_moved_by_fetching`)."""
        self.epoch(0, 1, 0, 0, 1).read_block(0)

    def cursor(self, epoch: int, position: int, batch_size: int) -> dict:
        """The cursor saved in a generation: the epoch, the global samples consumed in it, and
        where the block it is in starts (the shard and offset a resume reads from)."""
        consumed = min(position * batch_size, len(self))
        order = self.order(epoch)
        at, offset = order.locate(min(consumed // self.buffer * self.buffer, len(self) - 1))
        return {"epoch": epoch, "consumed": consumed, "shard": self.shards[order.shard_order[at]].name,
                "offset": offset, "buffer": self.buffer}


class StreamCursor:
    """The stream's cursor in a generation (`stream`): the global samples consumed in the
    epoch and the shard and offset its block starts at. It follows from the progress, which
    restores the order; a stored cursor that disagrees with it is a damaged generation."""

    def __init__(self, source: StreamSource, batch_size: int):
        self.source, self.batch_size = source, batch_size

    def state(self, progress) -> dict:
        return self.source.cursor(progress.epoch, progress.position, self.batch_size)

    def check(self, stored: dict, progress) -> None:
        if dict(stored) != self.state(progress):
            raise CorruptGeneration(f"the stored stream cursor {dict(stored)} disagrees with the progress (epoch "
                                    f"{progress.epoch}, batch {progress.position}: {self.state(progress)}); restore "
                                    f"an earlier generation with --from-generation")


def cursors(source: DataSource, batch_size: int) -> dict:
    """The cursors a generation stores for this data (none for map-style data)."""
    return {"stream": StreamCursor(source, batch_size)} if isinstance(source, StreamSource) else {}


DataSource = KeyedSeeding | StreamSource
"""What the loop fetches from: both give `loader(...)` of (sample ids, batch), `len()` (samples
per epoch), `fingerprint()` and `probe()`."""


def data_source(dataset, config: RunConfig, spec: str) -> tuple[RunConfig, DataSource]:
    """The workload's dataset as the trainer fetches it, and the run's configuration: a
    DataLoader is adopted (trainer/workload/adapters.py `from_loader`), its batch size and
    workers entering the configuration and its collate_fn running under the keyed RNGs;
    anything the trainer cannot make exact is refused in one line, before the run starts."""
    collate = None
    if is_loader(dataset):
        adopted = from_loader(dataset, config.workload, spec)
        dataset, collate, config = adopted.dataset, adopted.collate, replace(config, workload=adopted.config)
    return config, source_of(dataset, config.workload, spec, collate)


def source_of(dataset, config: WorkloadConfig, spec: str, collate=None) -> DataSource:
    """A stream (shards and a reader) or a map-style dataset; anything else is refused."""
    if is_hf_iterable(dataset):
        refuse_hf_shuffle(dataset, spec)
        raise UsageError(f"--workload {spec}: build_dataset returned a datasets.IterableDataset; wrap it as a stream: "
                         f"return trainer.workload.adapters.HFStream(dataset) (the trainer then owns its order, "
                         f"shuffle buffer and cursor)")
    if is_stream(dataset):
        return StreamSource(dataset, config.seed, config.shuffle_buffer, spec, collate)
    if isinstance(dataset, IterableDataset) or not callable(getattr(dataset, "__len__", None)) \
            or not callable(getattr(dataset, "__getitem__", None)):
        raise UsageError(f"--workload {spec}: build_dataset returned a {type(dataset).__name__}, which is neither "
                         f"map-style (__len__ and __getitem__) nor a stream: for an iterable dataset give "
                         f"shards() -> [(name, records)] and read(shard, offset) -> records from that offset, "
                         f"and the trainer owns the order, the shuffle buffer and the cursor (docs/workloads.md: Streaming data)")
    return KeyedSeeding(dataset, config.seed, collate)
