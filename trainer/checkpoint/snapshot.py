"""Writing and reading a recovery snapshot with torch.distributed.checkpoint (DCP).

The on-disk format is stock DCP (a `.metadata` file and `*.distcp` shards), so a generation
can always be read back by `dcp.load` or `format_utils.dcp_to_torch_save` without our code.
Our own reads never unpickle anything but DCP's metadata classes and plain values
(trainer/checkpoint/safe_load.py).

DCP is imported by the functions that write or read, not by this module: importing it costs
about 0.7 s (docs/development.md, start-up), which `from trainer import recovery`, `list` and a
claim do not need to pay.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import WriterConfig
from trainer.errors import CorruptGeneration, TrainerError, root_cause

# DCP warns on every call that it assumes a single process when no process group exists;
# that is exactly our intent, so the warning is noise in the progress log.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def write_snapshot(state_dict: dict, directory: Path, config: WriterConfig = WriterConfig(),
                   alone: bool | None = None) -> dict[str, dict]:
    """Write `state_dict` into `directory`, every shard fsynced; returns the shards'
    {bytes, digest}, hashed while writing, for the manifest. With several processes each rank
    writes, hashes and fsyncs its own shards (on shared storage rank 0's fsync could not make
    another node's writes durable). `alone`: this rank writes a snapshot of its own, without
    the others (a tier-0 part under torchrun); None: alone exactly when no process group exists."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.writer import HashingFileSystemWriter, RankZeroCopies

    writer = HashingFileSystemWriter(directory, config)
    try:
        dcp.save(state_dict, storage_writer=writer, planner=RankZeroCopies(),
                 no_dist=single_process() if alone is None else alone)
    except dcp.CheckpointException as error:
        raised = _raised_by_rank(error)
        if isinstance(raised, TrainerError):  # the writer's refusal of an unloadable value: one line
            raise raised from None
        raise
    return writer.digests


class StoredEntries(dict):
    """Flattened key -> DCP storage metadata (tensor shape/dtype, or bytes for objects), and
    in `paths` the nested path each key was flattened from (DCP's planner data): a key alone
    is ambiguous when a dict key holds a dot (`0.weight`) or was an integer (`state.0`)."""

    def __init__(self, entries: dict, paths: dict | None):
        super().__init__(entries)
        self.paths: dict[str, tuple] = dict(paths or {})


def stored_entries(directory: Path) -> StoredEntries:
    from trainer.checkpoint.safe_load import read_metadata

    metadata = read_metadata(directory)
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return StoredEntries(metadata.state_dict_metadata, planner_data)


def load_snapshot(template: dict, directory: Path, alone: bool | None = None, arrivals=None) -> None:
    """Fill `template` in place: tensors must be pre-allocated with the stored shapes;
    non-tensor values are replaced by the stored values (loaded weights-only). A refusal or
    a damaged value is raised as its own one-line error, not DCP's per-rank wrapper.
    `alone`: as for `write_snapshot` (a tier-0 part is read by its rank alone). `arrivals`:
    shards still arriving (`ParallelFileSystemReader`)."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.safe_load import ParallelFileSystemReader, SafeLoadPlanner

    try:
        dcp.load(template, storage_reader=ParallelFileSystemReader(directory, arrivals=arrivals),
                 planner=SafeLoadPlanner(),
                 no_dist=single_process() if alone is None else alone)
    except dcp.CheckpointException as error:  # DCP wraps whatever a rank raised
        raised = _raised_by_rank(error)
        if isinstance(raised, TrainerError):  # a refusal of ours, already one line
            raise raised from None
        cause = root_cause(raised)
        if isinstance(cause, OSError):
            raise cause from None
        detail = (str(cause).strip().splitlines() or ["no detail"])[0][:160]
        raise CorruptGeneration(f"{Path(directory).name} cannot be loaded ({cause.__class__.__name__}: {detail}); "
                                f"restore an earlier generation with --from-generation") from None


def _raised_by_rank(error: BaseException) -> BaseException:
    """The exception a rank raised inside DCP, out of its CheckpointException."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return _raised_by_rank(first[0] if isinstance(first, tuple) else first)
    return error


def flat_template(entries: dict) -> dict:
    """A template for every stored entry by its flattened key: tensors of the stored shapes,
    None for the other values (the load replaces them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key: torch.empty(entry.size, dtype=entry.properties.dtype)
            if isinstance(entry, TensorStorageMetadata) else None for key, entry in entries.items()}


def load_flat(directory: Path) -> dict:
    """Every stored entry by its flattened key, without knowing the model (for compare)."""
    flat = flat_template(stored_entries(directory))
    load_snapshot(flat, directory)
    return flat
