"""Writing and reading a recovery snapshot with torch.distributed.checkpoint (DCP).

The on-disk format is stock DCP (a `.metadata` file and `*.distcp` shards), so a generation
can always be read back by `dcp.load` or `format_utils.dcp_to_torch_save` without our code.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# DCP warns on every call that it assumes a single process when no process group exists;
# that is exactly our intent, so the warning is noise in the progress log.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def write_snapshot(state_dict: dict, directory: Path) -> None:
    """Write `state_dict` into `directory`. One process: files are fsynced later, while rank 0
    hashes them. Several processes: each rank fsyncs the shards it wrote itself, because on
    shared storage rank 0's fsync cannot make another node's writes durable."""
    writer = dcp.FileSystemWriter(str(directory), sync_files=not _single_process())
    dcp.save(state_dict, storage_writer=writer, no_dist=_single_process())


def stored_entries(directory: Path) -> dict:
    """Flattened key -> DCP storage metadata (tensor shape/dtype, or bytes for objects)."""
    return dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata


def load_snapshot(template: dict, directory: Path) -> None:
    """Fill `template` in place: tensors must be pre-allocated with the stored shapes;
    non-tensor values are replaced by the stored objects."""
    dcp.load(template, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=_single_process())


def load_flat(directory: Path) -> dict:
    """Every stored entry by its flattened key, without knowing the model (for compare)."""
    flat = {}
    for key, entry in stored_entries(directory).items():
        if isinstance(entry, TensorStorageMetadata):
            flat[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            flat[key] = None
    load_snapshot(flat, directory)
    return flat
