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
from trainer.data.ledger import UNKNOWN


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


@dataclass(frozen=True)
class Loaded:
    state: dict
    """Every stored field, flat."""
    ledger: dict
    """The manifest's sample ledger with its step (empty in generations written before ledgers)."""


def load_generation(path: Path) -> Loaded:
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
    manifest = verification.manifest
    ledger = manifest.facts.ledger if manifest.facts else {}
    return Loaded(load_flat(path), {"step": manifest.step, **ledger} if ledger else {})


def format_table(results: list[FieldResult]) -> str:
    width = max([len(r.field) for r in results] + [5])
    lines = [f"{'field':<{width}}  equal  first difference", f"{'-' * width}  -----  ----------------"]
    lines += [f"{r.field:<{width}}  {'yes' if r.equal else 'NO':<5}  {r.difference}" for r in results]
    differing = sum(not r.equal for r in results)
    verdict = "all equal" if not differing else f"{differing} differ"
    lines.append(f"{len(results)} fields compared: {verdict}")
    return "\n".join(lines)


def as_json(a: Path, b: Path, results: list[FieldResult], ledgers: tuple[dict, dict] = ({}, {})) -> dict:
    return {"a": str(a), "b": str(b), "equal": all(r.equal for r in results),
            "fields": [asdict(r) for r in results], "ledgers": {"a": ledgers[0], "b": ledgers[1]}}


def format_ledgers(a: dict, b: dict) -> str:
    """The two generations' sample ledgers side by side (trainer/data/ledger.py): informative,
    never part of the verdict (each covers the steps since its own previous generation, so
    cadence and interruptions change it; the chain since step 0 does not)."""
    if not a and not b:
        return ""

    def short(value) -> str:
        return value[:16] + "…" if isinstance(value, str) and len(value) > 16 else str(value)

    def row(name: str, of) -> str:
        left, right = (short(of(ledger)) if ledger else "-" for ledger in (a, b))
        return f"{name:<22} {left:<28} {right}"

    ranks = sorted(set(a.get("by_rank", {})) | set(b.get("by_rank", {})), key=int)
    lines = [f"{'sample ledger':<22} {'A':<28} B",
             row("steps", lambda e: f"{e['after_step'] + 1}..{e['step']}"),
             row("cursor (epoch, done)", lambda e: f"{tuple(e['from'])} → {tuple(e['to'])}"),
             row("samples", lambda e: e["samples"]), row("sha256", lambda e: e["sha256"]),
             row("chain since step 0", lambda e: e["chain"])]
    def of_rank(entry: dict, rank: str) -> str:
        kept = entry.get("by_rank", {}).get(rank)
        return f"{kept['samples']} {short(kept['sha256'])}" if kept else "-"

    lines += [row(f"rank {rank}", lambda entry, rank=rank: of_rank(entry, rank)) for rank in ranks]
    if not a or not b or UNKNOWN in (a.get("chain"), b.get("chain")):
        verdict = "the chains cannot be compared (a generation without a full ledger)"
    elif a["step"] != b["step"]:
        verdict = f"generations of different steps ({a['step']} and {b['step']}): the chains cover other samples"
    elif a["chain"] == b["chain"]:
        verdict = "same samples in the same order since step 0"
    else:
        verdict = "DIFFERENT samples or order since step 0"
    return "\n".join(lines + [f"ledgers: {verdict}", "", ""])

