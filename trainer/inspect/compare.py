"""Field-by-field, bit-for-bit comparison of two recovery generations.

"Equal" means equal bits: tensors by dtype, shape and raw bytes (a NaN equals a NaN with the
same payload, -0.0 differs from 0.0), floats by their IEEE-754 encoding. Nothing is
loosened: a comparison that passes proves the two trainings are in the same state.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trainer.errors import UntrustedGeneration, UsageError
from trainer.checkpoint.manifest import RECOVERY, verify_directory
from trainer.checkpoint.snapshot import load_flat


@dataclass(frozen=True)
class FieldResult:
    field: str
    equal: bool
    difference: str = ""


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """'' if bit-identical, else where and how the two first differ."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    a_bytes = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b_bytes = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(a_bytes, b_bytes):
        return ""
    first_byte = int((a_bytes != b_bytes).nonzero()[0])
    index = first_byte // a.element_size()
    a_flat, b_flat = a.reshape(-1), b.reshape(-1)
    position = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), a.shape)) if a.dim() else ()
    return f"at {list(position)}: {a_flat[index].item()!r} vs {b_flat[index].item()!r}"


def _float_bits(value: float) -> bytes:
    return struct.pack("<d", value)


def value_difference(a, b, where: str = "") -> str:
    """'' if equal (floats by bits, containers element by element), else the first difference."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"
        return tensor_difference(a, b)
    if type(a) is not type(b):
        return f"{where}{type(a).__name__} {a!r} vs {type(b).__name__} {b!r}"
    if isinstance(a, float):
        same = _float_bits(a) == _float_bits(b)
        return "" if same else f"{where}{a!r} vs {b!r}" + (" (sign of zero)" if a == b == 0 else "")
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if found := value_difference(x, y, f"{where}[{i}] "):
                return found
        return ""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{where}keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            if found := value_difference(a[key], b[key], f"{where}[{key!r}] "):
                return found
        return ""
    return "" if a == b else f"{where}{a!r} vs {b!r}"


def compare_states(a: dict, b: dict) -> list[FieldResult]:
    results = []
    for key in sorted(set(a) | set(b)):
        if key not in b:
            results.append(FieldResult(key, False, "missing in B"))
        elif key not in a:
            results.append(FieldResult(key, False, "missing in A"))
        else:
            difference = value_difference(a[key], b[key])
            results.append(FieldResult(key, not difference, difference))
    return results


def load_generation(path: Path) -> dict:
    """Verify, then load every stored field; an unusable input is a usage error (exit 2)."""
    if not path.exists():
        raise UsageError(f"{path}: no such directory; pass a generation, e.g. OUTPUT/checkpoints/step-00000064")
    if not path.is_dir():
        raise UsageError(f"{path} is not a generation directory; pass e.g. OUTPUT/checkpoints/step-00000064")
    if (path / "checkpoints").is_dir() and not (path / "manifest.json").exists():
        newest = sorted(p.name for p in (path / "checkpoints").glob("step-*") if (p / "manifest.json").is_file())
        example = newest[-1] if newest else "step-00000064"
        raise UsageError(f"{path} is a run directory, not a generation; pass {path}/checkpoints/{example} "
                         f"(a generation of that run)")
    verification = verify_directory(path)
    if verification.untrusted:
        raise UntrustedGeneration(f"{path} is refused: {verification.problem}")
    if not verification.ok:
        raise UsageError(f"{path} cannot be compared: {verification.problem}")
    if verification.manifest.kind != RECOVERY:
        raise UsageError(f"{path} is an {verification.manifest.kind}, not a recovery generation")
    return load_flat(path)


def format_table(results: list[FieldResult]) -> str:
    width = max([len(r.field) for r in results] + [5])
    lines = [f"{'field':<{width}}  equal  first difference", f"{'-' * width}  -----  ----------------"]
    lines += [f"{r.field:<{width}}  {'yes' if r.equal else 'NO':<5}  {r.difference}" for r in results]
    differing = sum(not r.equal for r in results)
    verdict = "all equal" if not differing else f"{differing} differ"
    lines.append(f"{len(results)} fields compared: {verdict}")
    return "\n".join(lines)


def as_json(a: Path, b: Path, results: list[FieldResult]) -> dict:
    return {"a": str(a), "b": str(b), "equal": all(r.equal for r in results),
            "fields": [asdict(r) for r in results]}

