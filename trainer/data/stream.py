"""Streaming data with a cursor the trainer owns: one order at every world size, each record
read once per epoch where the world size divides the run's lanes.

A streaming workload gives shards (name and record count) and a reader of one shard's
records from an offset (`trainer.workload.protocol.Stream`). The trainer decides everything
that makes a resume exact and the reading cheap, the way `batching.py` does for a map-style
dataset (docs/streaming.md tells the whole story with the measurements):

- **The epoch's stream**: the shards in an order drawn from (seed, epoch), read one after
  another. Only the samples an epoch trains on are in it (`--last-batch drop` leaves the
  stream's tail out: `trainer.data.order.EpochShape`).
- **Lanes**: the stream is cut into contiguous lanes, as many as the run's lanes: a count fixed
  when the run starts (`--stream-lanes`, else its world size then) and kept in the cursor, so
  it never follows the world size. Lane q holds the slots q, q+lanes, … of every global batch:
  batch b's share of a lane is its records [b·share, (b+1)·share), share = the slots the lane
  has in a batch (batch ÷ lanes when the lanes divide it; fewer in a short last batch).
- **Ranks**: rank r of R takes the slots r, r+R, … of every global batch (as for map-style
  data, and as the ledger puts them back), so it reads the block of every lane its slots fall
  in: lanes r, r+R, … alone when R divides the lanes (each lane read by one rank), else
  lanes/gcd(lanes, R) of them (each lane read by R/gcd ranks: 3x at 4 lanes on 3 ranks).
- **Blocks and chunks, the shuffle**: each lane is cut into blocks of `chunk` batches' shares
  (`--shuffle-buffer` rounded down to whole shares of lane 0, at least one), each shuffled by
  a permutation drawn from (seed, epoch, lanes, lane, block). Chunk k is every lane's block k:
  global batches [k·chunk, (k+1)·chunk). The buffer is the block: never saved, a pure
  function of the cursor; a resume re-reads the blocks it is in.
- **Readers**: a rank's DataLoader hands out whole chunks, worker w the chunks w, w+W, …,
  which the DataLoader returns in turn: each worker reads only its own blocks, and every
  worker count gives the same batches in the same order. Read volume per epoch: each record
  once where the world size divides the lanes (plus, after a resume, the rest of the blocks
  it starts in), R/gcd(lanes, R) times otherwise, whatever the workers. Memory: a worker
  holds the blocks of its rank's lanes while it builds a chunk; a chunk's batches wait in the
  DataLoader's queue, up to two per worker.
- **The cursor**: samples consumed in the epoch, global, the lanes of the epoch's layout and
  the run's, saved in every generation (`stream`, checked against the progress on restore)
  with where each lane's block in progress starts.

The global order is a pure function of (seed, epoch, lanes, buffer, batch, `--last-batch`),
never of the world size or the workers (Mosaic StreamingDataset's "canonical nodes": the
order is laid out for a node count fixed for the run; the physical nodes read their share
of it). So a resume under another world size trains on the samples, in the order, of the
uninterrupted run, in every later epoch too; the ledger's chain proves it and `report` finds
none repeated or skipped. The cost of a world size that does not divide the lanes is reading.
Sample ids, for the ledger, number the records in the declared shard order.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from trainer.data.fetching import COLLATE
from trainer.data.global_rngs import seeded_globals
from trainer.data.order import EpochShape, Fetched
from trainer.data.workers import WorkerSignals
from trainer.errors import CorruptGeneration, UsageError, option

log = logging.getLogger("trainer")

READ = 2
"""The `purpose` of the seeds a block's read runs under, apart from samples' and collates'."""
ONE_RECORD = 0
"""A lone record's read (a padded share), apart from blocks' (whose lanes are at least 1)."""


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
            raise UsageError(f"{option('--workload', spec)}: shards() gave {shard!r}; give (name, records) pairs or objects "
                             f"with a str `name` and an int `records` >= 0 (the trainer numbers samples by them)")
        found.append(Shard(shard, name, records))
    if not found or sum(shard.records for shard in found) == 0:
        raise UsageError(f"{option('--workload', spec)}: shards() gave no records; a stream needs at least one record")
    if len({shard.name for shard in found}) != len(found):
        raise UsageError(f"{option('--workload', spec)}: shards() gave two shards of one name; names must be unique")
    return tuple(found)


class StreamLayout:
    """One epoch's layout: where the record at each slot of each global batch sits in the
    shards (see the module docstring). Pure: (records per shard, seed, epoch, buffer, the
    epoch's shape, lanes) decide it; the world size does not."""

    def __init__(self, records: Sequence[int], seed: int, epoch: int, buffer: int, shape: EpochShape, lanes: int):
        self.seed, self.epoch, self.shape, self.lanes = seed, epoch, shape, lanes
        self.first_id = np.concatenate([[0], np.cumsum(records)])[:-1]
        """The id of each shard's first record (ids follow the declared shard order)."""
        self.shard_order = np.random.default_rng([seed, epoch, 0x5A]).permutation(len(records))
        self.stream_start = np.concatenate([[0], np.cumsum([records[shard] for shard in self.shard_order])])
        """Where each shard (in this epoch's order) starts in the epoch's stream."""
        self.shares = [len(range(lane, shape.batch_size, lanes)) for lane in range(lanes)]
        """A full batch's records in each lane: its slots lane, lane + lanes, … (equal when the
        lanes divide the batch; 0 in a lane beyond the batch)."""
        self.chunk = max(1, buffer // self.shares[0])
        """Global batches per chunk: a lane's block holds their shares."""
        self.blocks = [self.chunk * share for share in self.shares]
        """Each lane's block: records per shuffle buffer."""
        last = shape.batches - 1
        self.lane_length = [last * share + len(shape.share(last, lane, lanes)) if shape.batches else 0
                            for lane, share in enumerate(self.shares)]
        self.lane_start = np.concatenate([[0], np.cumsum(self.lane_length)]).tolist()
        self.permutations: dict[tuple[int, int], np.ndarray] = {}
        """The last blocks' permutations (a cache: a reader moves forward, chunk by chunk)."""

    @property
    def chunks(self) -> int:
        return -(-self.shape.batches // self.chunk)

    def block_span(self, lane: int, block: int) -> tuple[int, int]:
        """(stream position, records) of a lane's block."""
        size = self.blocks[lane]
        start = block * size
        return self.lane_start[lane] + start, max(0, min(size, self.lane_length[lane] - start))

    def block_permutation(self, lane: int, block: int) -> np.ndarray:
        if (lane, block) not in self.permutations:
            if len(self.permutations) >= 4 * self.lanes:
                del self.permutations[min(self.permutations, key=lambda key: key[1])]
            self.permutations[lane, block] = np.random.default_rng(
                [self.seed, self.epoch, self.lanes, lane, block, 0xB1]).permutation(self.block_span(lane, block)[1])
        return self.permutations[lane, block]

    def slot(self, batch: int, slot: int) -> tuple[int, int]:
        """(lane, record of the lane) of a global batch's slot."""
        lane = slot % self.lanes
        return lane, batch * self.shares[lane] + slot // self.lanes

    def stream_position(self, lane: int, record: int) -> int:
        block, inside = divmod(record, self.blocks[lane])
        return self.block_span(lane, block)[0] + int(self.block_permutation(lane, block)[inside])

    def locate(self, stream_position: int) -> tuple[int, int]:
        """(index into this epoch's shard order, offset inside that shard) of a stream position."""
        at = int(np.searchsorted(self.stream_start, stream_position, side="right")) - 1
        return at, stream_position - int(self.stream_start[at])

    def sample_id(self, stream_position: int) -> int:
        at, offset = self.locate(stream_position)
        return int(self.first_id[self.shard_order[at]]) + offset

    def sample_ids(self, stream_positions: np.ndarray) -> list[int]:
        """`sample_id` of many positions at once."""
        at = np.searchsorted(self.stream_start, stream_positions, side="right") - 1
        return (self.first_id[self.shard_order[at]] + stream_positions - self.stream_start[at]).tolist()

    def ids(self, batch: int, slots: Sequence[int]) -> list[int]:
        """The sample ids at slots of a global batch."""
        return [self.sample_id(self.stream_position(*self.slot(batch, slot))) for slot in slots]


class StreamEpoch(IterableDataset):
    """One rank's micro-batches of one epoch from a batch position on, by chunk: each item
    is the rank's `Fetched` of one chunk; under DataLoader workers each builds every W-th."""

    def __init__(self, source: StreamSource, layout: StreamLayout, start_batch: int, rank: int, world_size: int):
        self.stream, self.shards, self.collate, self.layout = source.stream, source.shards, source.collate, layout
        self.reads_to_stop = source.reads_to_stop
        self.start_batch, self.rank, self.world_size = start_batch, rank, world_size

    def chunks(self) -> range:
        return range(self.start_batch // self.layout.chunk, self.layout.chunks)

    def __iter__(self) -> Iterator[list[Fetched]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for chunk in self.chunks()[worker::workers]:
            yield self.chunk_batches(chunk)

    def chunk_batches(self, chunk: int) -> list[Fetched]:
        """The rank's micro-batches of a chunk, reading the block of each lane its slots fall
        in (one lane, but for the rest of an epoch after a world-size change). A rank with no
        share of a batch (`--last-batch pad`) reads the batch's first record alone."""
        layout, shape, blocks, fetched = self.layout, self.layout.shape, {}, []
        first = max(self.start_batch, chunk * layout.chunk)
        for batch in range(first, min((chunk + 1) * layout.chunk, shape.batches)):
            weight = shape.weight(batch, self.rank, self.world_size)
            slots = shape.share(batch, self.rank, self.world_size) if weight else range(1)
            samples, ids = [], []
            for slot in slots:
                lane, record = layout.slot(batch, slot)
                if not weight:  # a padded share: the batch's first record, alone
                    position = layout.stream_position(lane, record)
                    samples.append(self.read(position, 1, position, ONE_RECORD)[0])
                    ids.append(layout.sample_id(position))
                    continue
                if lane not in blocks:
                    blocks[lane] = self.read_block(lane, chunk)
                held, order, held_ids = blocks[lane]
                inside = record - chunk * layout.blocks[lane]
                samples.append(held[order[inside]])
                ids.append(held_ids[inside])
            fetched.append(Fetched(torch.tensor(ids, dtype=torch.int64),
                                   self.collated(samples, batch * shape.batch_size + slots[0]), weight))
        return fetched

    def read_block(self, lane: int, chunk: int) -> tuple[list, list[int], list[int]]:
        """A lane's block of a chunk: its records in stream order, its permutation, and the
        sample id at each of its shuffled places."""
        layout = self.layout
        start, size = layout.block_span(lane, chunk)
        order = layout.block_permutation(lane, chunk)
        return self.read(start, size, chunk, layout.lanes, lane), order.tolist(), layout.sample_ids(start + order)

    def read(self, start: int, wanted: int, index: int, *purpose: int) -> list:
        """`wanted` records of the epoch's stream from `start`, through the workload's
        `read(shard, offset)` (with the global RNGs keyed by `index` and `purpose`: a block's
        chunk, lanes and lane, or a lone record's position; should the reader draw any),
        crossing into the next shards of the epoch's order as needed."""
        layout = self.layout
        records: list = []
        at, offset = layout.locate(start)
        with seeded_globals(layout.seed, layout.epoch, index, READ, *purpose):
            while len(records) < wanted:
                shard = self.shards[layout.shard_order[at]]
                take = min(wanted - len(records), shard.records - offset)
                stop = (offset + take,) if self.reads_to_stop else ()
                got = list(islice(self.stream.read(shard.handle, offset, *stop), take))
                if len(got) != take:
                    raise ValueError(f"shard {shard.name!r} gave {offset + len(got)} records, but shards() "
                                     f"declared {shard.records}")
                records.extend(got)
                at, offset = at + 1, 0
        return records

    def collated(self, samples: list, first_position: int):
        if self.collate is None:
            return default_collate(samples)
        with seeded_globals(self.layout.seed, self.layout.epoch, first_position, COLLATE):
            return self.collate(samples)


def takes_stop(read) -> bool:
    """Whether a stream's `read(shard, offset[, stop])` accepts a third argument."""
    try:
        parameters = inspect.signature(read).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in positional)


class StreamSource:
    """A stream bound to the trainer: its shards, checked once, the run's lanes, and its
    epochs' loaders."""

    def __init__(self, stream, seed: int, buffer: int, spec: str, collate=None, lanes: int | None = None):
        self.stream, self.seed, self.buffer = stream, seed, buffer
        self.collate = collate or getattr(stream, "collate", None)
        """A DataLoader's `collate_fn` (adopted), else the stream's own `collate`, else None."""
        self.shards = shards_of(stream, spec)
        self.records = tuple(shard.records for shard in self.shards)
        self.reads_to_stop = takes_stop(stream.read)
        """Whether `read` takes `stop` (the record it may stop before): a reader that fetches
        ahead (ranged GETs) then asks for no more than the trainer uses."""
        self.lanes_given = lanes
        """`--stream-lanes`, or None: the world size the run started with."""
        self.run_lanes = lanes
        """The lanes every epoch is laid out in: given, else fixed when the run starts
        (`cursors`: the world size) or restores (`StreamCursor.check`: the stored count)."""
        self.carried: dict[int, int] = {}
        """{epoch: lanes} of an epoch in progress laid out in other lanes than the run's now
        (--stream-lanes changed under --allow-drift config): it finishes in its layout."""

    def __len__(self) -> int:
        return sum(self.records)

    def lanes(self, epoch: int, world_size: int) -> int:
        """The lanes `epoch` is laid out in (`world_size`: a source no run has fixed lanes for)."""
        return self.carried.get(epoch) or self.run_lanes or world_size

    def layout(self, shape: EpochShape, epoch: int, lanes: int) -> StreamLayout:
        return StreamLayout(self.records, self.seed, epoch, self.buffer, shape, lanes)

    def loader(self, shape: EpochShape, epoch: int, start_batch: int, rank: int, world_size: int,
               num_workers: int) -> Iterator[Fetched]:
        """This rank's micro-batches for the rest of the epoch, in order. A private generator
        keeps the DataLoader off the global torch RNG (as `fetching.epoch_loader`)."""
        layout = self.layout(shape, epoch, self.lanes(epoch, world_size))
        chunks = DataLoader(StreamEpoch(self, layout, start_batch, rank, world_size), batch_size=None,
                            num_workers=num_workers, generator=torch.Generator().manual_seed(0),
                            worker_init_fn=WorkerSignals(os.getpid()))
        for chunk in chunks:
            yield from chunk

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
        `trainer.data.fetching.refuse_state_moved_by_fetching`)."""
        StreamEpoch(self, self.layout(EpochShape(len(self), 1), 0, 1), 0, 0, 1).read(0, 1, 0, ONE_RECORD)

    def cursor(self, shape: EpochShape, epoch: int, position: int, lanes: int, run_lanes: int) -> dict:
        """The cursor saved in a generation: the epoch, the global samples consumed in it, the
        lanes of its layout and the run's (equal unless --stream-lanes changed mid-epoch), and
        where each lane's block in progress starts ("shard@offset": what a resume reads from)."""
        layout = self.layout(shape, epoch, lanes)
        chunk = min(position // layout.chunk, max(0, layout.chunks - 1))
        blocks = []
        for lane in range(lanes):
            at, offset = layout.locate(min(layout.block_span(lane, chunk)[0], len(self) - 1))
            blocks.append(f"{self.shards[layout.shard_order[at]].name}@{offset}")
        return {"epoch": epoch, "consumed": min(position * shape.batch_size, shape.trained), "lanes": lanes,
                "run_lanes": run_lanes, "buffer": self.buffer, "blocks": blocks}


class StreamCursor:
    """The stream's cursor in a generation (`stream`). It follows from the progress and the
    lanes; a stored cursor that disagrees is a damaged generation. Restoring one fixes the
    run's lanes: a resume under another world size keeps the lanes the run started with."""

    def __init__(self, source: StreamSource, shape: EpochShape, world_size: int):
        self.source, self.shape, self.world_size = source, shape, world_size

    def state(self, progress) -> dict:
        source = self.source
        return source.cursor(self.shape, progress.epoch, progress.position,
                             source.lanes(progress.epoch, self.world_size), source.run_lanes or self.world_size)

    def check(self, stored: dict, progress) -> None:
        """Check the stored cursor and adopt its lanes (unless --stream-lanes names others,
        a drift the fingerprint let through: then an epoch in progress finishes in its own)."""
        stored, source = dict(stored), self.source
        if "run_lanes" not in stored:
            if progress.position == 0:
                return  # an epoch's start: nothing of it was read; the run's lanes start here
            how = "laid each epoch out for its world size" if "lanes" in stored else "split streams by sample index"
            raise CorruptGeneration(f"the stored stream cursor {stored} was written by a trainer that {how}, not in "
                                    f"lanes fixed for the run; finish its epoch with that trainer, or restore a "
                                    f"generation at an epoch's start with --from-generation")
        expected = source.cursor(self.shape, progress.epoch, progress.position, stored["lanes"], stored["run_lanes"])
        if stored != expected:
            raise CorruptGeneration(f"the stored stream cursor {stored} disagrees with the progress (epoch "
                                    f"{progress.epoch}, batch {progress.position}: {expected}); restore "
                                    f"an earlier generation with --from-generation")
        if source.lanes_given is None:  # given lanes were noted by `cursors`
            source.run_lanes = stored["run_lanes"]
            note_reading(source.run_lanes, self.world_size)
        if progress.position and stored["lanes"] != source.run_lanes:
            source.carried[progress.epoch] = stored["lanes"]


def reads_per_record(lanes: int, world_size: int) -> int:
    """How many times an epoch reads each record: once where the world size divides the lanes,
    else world size / gcd (each lane's slots are spread over that many ranks)."""
    return world_size // math.gcd(lanes, world_size)


def note_reading(lanes: int, world_size: int) -> None:
    """Say (rank 0's log) what a world size the lanes do not divide costs, and the way out."""
    if (times := reads_per_record(lanes, world_size)) > 1:
        log.info("stream: %d lanes on %d processes: each record is read %d times per epoch (the order stays the "
                 "run's); a run started with --stream-lanes N, N a multiple of every world size it may run at "
                 "(12, 24, 48), reads each once", lanes, world_size, times)
