"""Which data a run reads, as the trainer fetches it: a stream (shards and a reader, its cursor
in every generation: `trainer/data/stream.py`) or a map-style dataset (keyed fetching:
`trainer/data/fetching.py`); a DataLoader adopted; anything else refused in one line."""

from __future__ import annotations

from dataclasses import replace

from torch.utils.data import IterableDataset

from trainer.config import RunConfig, WorkloadConfig
from trainer.data.fetching import KeyedSeeding, refuse_undeclared_draws
from trainer.data.order import EpochShape
from trainer.data.stream import StreamCursor, StreamSource, note_reading
from trainer.errors import UsageError, option
from trainer.workload.adapters import from_loader, is_hf_iterable, is_loader, refuse_hf_shuffle
from trainer.workload.protocol import is_stream


def cursors(source: DataSource, shape: EpochShape, world_size: int) -> dict:
    """The cursors a generation stores for this data (none for map-style data). A stream's
    lanes are fixed here for a run starting now (`--stream-lanes`, else `world_size`); a
    restored cursor replaces them by the run's own."""
    if not isinstance(source, StreamSource):
        return {}
    if source.run_lanes is None:
        source.run_lanes = world_size
    note_reading(source.run_lanes, world_size)
    return {"stream": StreamCursor(source, shape, world_size)}


DataSource = KeyedSeeding | StreamSource
"""What the loop fetches from: both give `loader(...)` of `Fetched`, `len()` (samples
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
        raise UsageError(f"{option('--workload', spec)}: build_dataset returned a datasets.IterableDataset; wrap it as a stream: "
                         f"return trainer.workload.adapters.HFStream(dataset) (the trainer then owns its order, "
                         f"shuffle buffer and cursor)")
    if is_stream(dataset):
        return StreamSource(dataset, config.seed, config.shuffle_buffer, spec, collate, config.stream_lanes)
    if isinstance(dataset, IterableDataset) or not callable(getattr(dataset, "__len__", None)) \
            or not callable(getattr(dataset, "__getitem__", None)):
        raise UsageError(f"{option('--workload', spec)}: build_dataset returned a {type(dataset).__name__}, which is neither "
                         f"map-style (__len__ and __getitem__) nor a stream: for an iterable dataset give "
                         f"shards() -> [(name, records)] and read(shard, offset) -> records from that offset, "
                         f"and the trainer owns the order, the shuffle buffer and the cursor (docs/streaming.md)")
    source = KeyedSeeding(dataset, config.seed, collate)
    refuse_undeclared_draws(source, option("--workload", spec))
    return source
