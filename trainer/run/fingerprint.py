"""The runtime fingerprint: what must not change silently between attempts.

Computing it does a little I/O (reading our own source files); comparing two fingerprints
is pure. A difference refuses the resume unless the operator allows that field explicitly.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import numpy

from trainer.errors import FingerprintMismatch

if TYPE_CHECKING:
    import torch

FIELDS = ("source", "dataset", "config", "python", "torch", "numpy", "os", "arch", "device", "world_size")
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
"""The trainer package (this file is in trainer/run/): `source` hashes all of it."""


def source_digest(root: Path = PACKAGE_ROOT, workload: tuple[Path, ...] = ()) -> str:
    """sha256 over every .py file of the trainer package (relative path and content), then
    over the workload's source outside it (each package directory's .py files, or a module
    file). With the default workload (inside the package) this is the trainer's digest
    alone, as it always was."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    for source in workload:
        files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
        for path in files:
            name = path.relative_to(source.parent).as_posix()
            digest.update(b"workload\0" + name.encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def device_kind(device: torch.device) -> str:
    import torch  # here, not at import: the CLI reads FIELDS for every command, most need no torch

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def current_fingerprint(config: dict, dataset_digest: str, device: torch.device, world_size: int,
                        workload_sources: tuple[Path, ...] = ()) -> dict:
    import torch

    return {
        "source": source_digest(workload=workload_sources),
        "dataset": dataset_digest,
        "config": dict(sorted(config.items())),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "os": platform.system(),
        "arch": platform.machine(),
        "device": device_kind(device),
        "world_size": world_size,
    }


def _short(value) -> str:
    text = str(value)
    return text[:12] + "…" if len(text) > 16 and " " not in text else text


def fingerprint_diff(old: dict, new: dict) -> list[tuple[str, str, object, object]]:
    """(field, detail, old, new) for every difference; `config` is compared per option."""
    differences = []
    for name in FIELDS:
        before, after = old.get(name), new.get(name)
        if name == "config" and isinstance(before, dict) and isinstance(after, dict):
            for key in sorted(set(before) | set(after)):
                if before.get(key) != after.get(key):
                    differences.append((name, f"config.{key}", before.get(key), after.get(key)))
        elif before != after:
            differences.append((name, name, before, after))
    return differences


def describe_diff(differences: list[tuple[str, str, object, object]]) -> str:
    return "; ".join(f"{detail} {_short(old)} → {_short(new)}" for _, detail, old, new in differences)


def check_fingerprint(generation: str, old: dict, new: dict, allowed: tuple[str, ...]) -> list[str]:
    """Raise unless every differing field is allowed; return the allowed differences
    (to be written into the attempt record and the next manifest)."""
    differences = fingerprint_diff(old, new)
    refused = [d for d in differences if d[0] not in allowed]
    if refused:
        fields = sorted({d[0] for d in refused})
        flags = " ".join(f"--allow-drift {name}" for name in fields)
        raise FingerprintMismatch(
            f"{generation} was written in a different environment: {describe_diff(refused)}; "
            f"restore that environment, or accept the change with {flags} (exactness is then not promised)")
    return [f"{detail}: {old} → {new}" for _, detail, old, new in differences]
