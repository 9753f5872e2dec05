"""Reading a generation without running code from it: the trust boundary of every load.

Stock DCP reads `.metadata` with a plain `pickle.load` and every non-tensor value (a BYTE_IO
item) with `torch.load(weights_only=False)`: anyone who can write a run directory or its
prefix in a bucket can plant a pickle whose `__reduce__` runs a command in the next process
that loads it, and the manifest's file digests cannot tell (it detects corruption, not tampering:
the attacker rewrites it too). So every read path of the trainer goes through this module:

* `.metadata` is unpickled by `AllowlistUnpickler`, which admits only DCP's metadata classes
  and the torch and builtin types they hold (trainer/checkpoint/allowlist.py, pinned against
  the torch version and resolved by tests/test_compat.py); anything else, a file over
  `MAX_METADATA_BYTES`, a truncated or malformed pickle, a shard name outside the directory,
  is refused (UntrustedGeneration or CorruptGeneration, exit 65) naming the file;
* non-tensor values are loaded with `torch.load(weights_only=True)` (`SafeLoadPlanner`), and
  tensors already are by DCP's reader; a value that needs any other global is refused,
  naming it, the key and the file. The writer refuses to store such a value in the first
  place (`unsafe_globals`, used by trainer/checkpoint/writer.py).

The on-disk format stays stock DCP: `dcp.load` with stock torch still reads a generation
(the values it holds are tensors and plain Python values), it just trusts what it reads.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from trainer import compat
from trainer.checkpoint.allowlist import MAX_METADATA_BYTES, AllowlistUnpickler, UnsafeGlobal, unreadable
from trainer.errors import CorruptGeneration, UntrustedGeneration
from trainer.layout import SNAPSHOT_INDEX, SNAPSHOT_SHARD_SUFFIX


def read_metadata(directory: Path) -> Metadata:
    """The generation's DCP metadata, unpickled through the allowlist and checked for shape."""
    path = Path(directory) / SNAPSHOT_INDEX
    where = f"{Path(directory).name}/{SNAPSHOT_INDEX}"
    size = path.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise CorruptGeneration(f"{where} is {size} bytes, more than any DCP index ({MAX_METADATA_BYTES} at most); "
                                f"{RESTORE_ADVICE}")
    metadata = unpickle_metadata(path.read_bytes(), where)
    problem = structure_problem(metadata, Path(directory))
    if problem:
        raise CorruptGeneration(f"{where}: {problem}; {RESTORE_ADVICE}")
    return metadata


RESTORE_ADVICE = ("it was damaged or tampered with; restore an earlier generation with --from-generation, "
                  "or start a new --output")


def unpickle_metadata(data: bytes, where: str) -> Metadata:
    try:
        metadata = AllowlistUnpickler(io.BytesIO(data)).load()
    except UnsafeGlobal as name:
        raise UntrustedGeneration(f"{where} names {name}, which is not a DCP metadata class, so it is not "
                                  f"unpickled (it could run code); {RESTORE_ADVICE}") from None
    except Exception as error:  # a truncated file, an unknown protocol, wrong arguments: all data problems
        raise CorruptGeneration(f"{where} is not a readable DCP index ({unreadable(error)}); {RESTORE_ADVICE}") \
            from None
    if not isinstance(metadata, Metadata):
        raise CorruptGeneration(f"{where} holds a {type(metadata).__name__}, not DCP metadata; {RESTORE_ADVICE}")
    return metadata


def structure_problem(metadata: Metadata, directory: Path) -> str | None:
    """What makes well-formed allowlisted objects still unusable: wrong types where DCP
    expects its own, or a shard name that leaves the directory (DCP joins it to the path)."""
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
            isinstance(key, str) and isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata))
            for key, entry in entries.items()):
        return "its entries are not DCP storage metadata"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "its storage index is not a mapping"
    storage_info = compat.DCP_STORAGE_INFO.resolve()
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, storage_info):
            return "its storage index holds other objects than DCP's"
        name = info.relative_path
        if not (isinstance(name, str) and "/" not in name and name.endswith(SNAPSHOT_SHARD_SUFFIX)
                and name != SNAPSHOT_SHARD_SUFFIX and not name.startswith(".")):
            return f"it points at {name!r}, which is not a shard file of this directory"
        if not (directory / name).is_file():
            return f"it points at {name}, which is missing"
        if not all(isinstance(value, int) and value >= 0 for value in (info.offset, info.length)):
            return f"it gives {name} a negative or non-integer range"
        if info.transform_descriptors:
            return f"it asks for stream transforms {info.transform_descriptors!r}, which this trainer never writes"
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        return "its storage_meta is not DCP's"
    return None


def unsafe_globals(data: bytes) -> list[str]:
    """Globals a `torch.save` blob needs beyond what `torch.load(weights_only=True)` admits
    (empty when it loads without running code). torch's own public scanner."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception as error:  # not a torch.save zip at all
        return [f"(unreadable: {error.__class__.__name__})"]


def refused_global(error: BaseException) -> list[str]:
    """The global `torch.load(weights_only=True)` refused, as its error names it: the one way
    to name it for a blob in torch's legacy (non-zip) format, which torch's scanner cannot read."""
    named = re.search(r"GLOBAL ([\w.]+)", str(error))
    return [named.group(1)] if named else []


class UnsafeValue(Exception):
    """A stored value that does not load weights-only (internal: the reader adds the file)."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor value is loaded with
    `torch.load(weights_only=True)` instead of `weights_only=False`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        data = value.getvalue()
        try:
            loaded = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as error:
            names = [name for name in unsafe_globals(data) if not name.startswith("(")] or refused_global(error)
            what = f"needs {', '.join(names)}" if names else f"does not load ({error.__class__.__name__})"
            raise UnsafeValue(f"the value of {key} {what}") from None
        if self.flatten_state_dict:
            compat.set_element(self.original_state_dict, self.mappings[key], loaded)
        else:
            self.state_dict[key] = loaded


class SafeFileSystemReader(dcp.FileSystemReader):
    """`FileSystemReader` whose `.metadata` goes through `read_metadata` above, and whose
    load failures of a stored value name the file."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CorruptGeneration("per-rank DCP metadata files are never written by this trainer")
        metadata = read_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_file_items(self, plan, planner, relative_path: str):
        """Stock `read_data` on a plan that reads one file, its failures named by the file."""
        where = f"{Path(self.path).name}/{relative_path}"
        try:
            return super().read_data(plan, planner)
        except UnsafeValue as reason:
            raise UntrustedGeneration(f"{where}: {reason}, which is never unpickled (it could run code); "
                                      f"{RESTORE_ADVICE}") from None
        except pickle.UnpicklingError as error:  # DCP loads tensor records weights-only itself
            named = refused_global(error)
            what = f"needs {named[0]}" if named else f"does not load weights-only ({unreadable(error)})"
            raise UntrustedGeneration(f"{where}: a tensor record {what}, which is never unpickled (it could run "
                                      f"code); {RESTORE_ADVICE}") from None


READ_THREADS = 4


class ParallelFileSystemReader(SafeFileSystemReader):
    """The safe `FileSystemReader`, but the shard files are read concurrently, one thread per
    file: stock DCP reads file after file on one thread, which leaves a disk that serves
    parallel reads (and the cores that deserialize) idle. Each thread runs the stock
    `read_data` on the part of the plan that reads its file, so the parsing is unchanged,
    its items in file order. `arrivals` (trainer/checkpoint/onepass.py `Arrivals`): shards
    still being written (a streamed download); each item waits until its bytes are there."""

    def __init__(self, path: str | Path, threads: int = READ_THREADS, arrivals=None):
        super().__init__(str(path))
        self.threads = threads
        self.arrivals = arrivals

    def _slice_file(self, file, sinfo):
        if self.arrivals is not None:
            self.arrivals.wait(sinfo.relative_path, sinfo.offset + sinfo.length)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for item in sorted(plan.items, key=lambda item: self.storage_data[item.storage_index].offset):
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        parts = [(dataclasses.replace(plan, items=items), file) for file, items in per_file.items()]
        with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(parts)))) as pool:
            for done in pool.map(lambda part: self.read_file_items(part[0], planner, part[1]), parts):
                done.wait()
        finished: Future[None] = Future()
        finished.set_result(None)
        return finished
