"""The allowlist of DCP's `.metadata` pickle: which globals reading a generation may resolve.

A `.metadata` is a pickle, and a pickle can name any importable callable and have it called
(`__reduce__`), so a plain `pickle.load` of a file from a run directory runs whatever its
writer chose. `AllowlistUnpickler` resolves only `METADATA_GLOBALS` and torch dtypes, and
refuses everything else before anything is called: its `find_class` is the only way a
pickle reaches a global. Checked against torch `CHECKED_TORCH` (tests/test_compat.py
resolves every name and compares the dtype names with the installed torch).

This module does not import torch: every verification of a generation checks its `.metadata`
with `metadata_problem`, which unpickles it against stand-ins of the same allowlist, before
anything imports torch to load it; the loader (trainer/checkpoint/safe_load.py) resolves the
same names to the real classes.
"""

from __future__ import annotations

import importlib
import io
import pickle

CHECKED_TORCH = "2.13.0"
"""The torch version whose `.metadata` pickles the names below were checked against."""
METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})
"""Every global a DCP `.metadata` may name besides dtypes. Each is a plain dataclass, an
enum, a path, a dict or a lookup of a layout by name: constructing one from the file's
arguments runs no code of the file's choosing. `pathlib` is there because DCP records the
checkpoint directory in `storage_meta`."""
TORCH_DTYPES = frozenset({
    "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble", "cfloat", "chalf",
    "complex128", "complex32", "complex64", "double", "float", "float16", "float32", "float4_e2m1fn_x2", "float64",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int", "int1",
    "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64", "int7", "int8", "long", "qint32", "qint8",
    "quint2x4", "quint4x2", "quint8", "short", "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5",
    "uint6", "uint64", "uint7", "uint8"})
"""`torch.<name>` attributes that are dtypes (a tensor's dtype is pickled by name)."""
MAX_METADATA_BYTES = 256 << 20
"""A `.metadata` larger than this is refused before it is read: a model with a million
tensors across a thousand ranks stays far below; a planted multi-gigabyte file would only
exhaust memory."""


class UnsafeGlobal(Exception):
    """The pickle names a global outside the allowlist; the message is the global's name."""


def allowed(module: str, name: str) -> bool:
    return (module, name) in METADATA_GLOBALS or (module == "torch" and name in TORCH_DTYPES)


class AllowlistUnpickler(pickle.Unpickler):
    """Resolves only allowed globals (through `resolve`, by default the real ones) and refuses
    persistent ids (DCP metadata has none)."""

    def find_class(self, module: str, name: str):
        if not allowed(module, name):
            raise UnsafeGlobal(f"{module}.{name}")
        return self.resolve(module, name)

    def resolve(self, module: str, name: str):
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid):
        raise UnsafeGlobal("a persistent id")


class _StandIn:
    """What every allowed global becomes when only the allowlist is checked: callable and
    constructible with any arguments, takes any state, does nothing."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _StandIn()

    def __setstate__(self, state):
        pass


class _CheckingUnpickler(AllowlistUnpickler):
    def resolve(self, module: str, name: str):
        return _StandIn


def unreadable(error: BaseException) -> str:
    """A pickle error in a few words: truncated data, an unknown protocol, wrong arguments."""
    lines = str(error).strip().splitlines()
    return f"{error.__class__.__name__}: {lines[0][:160] if lines else 'no detail'}"


def metadata_problem(data: bytes) -> tuple[str, bool] | None:
    """Why this `.metadata` cannot be read without running code, or is no readable pickle:
    (reason, whether it is a refused global), or None. Nothing of the file is executed: every
    allowed global is a stand-in here."""
    if len(data) > MAX_METADATA_BYTES:
        return f"is {len(data)} bytes, more than any DCP index ({MAX_METADATA_BYTES} at most)", False
    try:
        loaded = _CheckingUnpickler(io.BytesIO(data)).load()
    except UnsafeGlobal as name:
        return f"names {name}, which is not a DCP metadata class, so it is never unpickled (it could run code)", True
    except Exception as error:  # truncated, unknown protocol, a bomb that runs out of stack: all data problems
        return f"is not a readable DCP index ({unreadable(error)})", False
    if not isinstance(loaded, _StandIn):  # DCP's index is a Metadata object, not a plain value
        return f"holds a {type(loaded).__name__}, not DCP metadata", False
    return None
