"""The runtime fingerprint: what must not change silently between attempts.

Computing it does a little I/O (reading our own source files); comparing two fingerprints
is pure. A difference refuses the resume unless the operator allows that field explicitly.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import numpy

from trainer.errors import FingerprintMismatch, option

if TYPE_CHECKING:
    import torch

FIELDS = ("source", "dataset", "config", "python", "torch", "numpy", "os", "arch", "device", "world_size")
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
"""The trainer package (this file is in trainer/run/): `source` hashes all of it."""
SOURCE_FILES = "source_files"
"""Beside `source`, not one of FIELDS: each file's digest, to name what changed."""
SHOWN_FILES = 4
"""Changed files a refusal names (then `+N more`)."""


def source_files(root: Path = PACKAGE_ROOT, workload: tuple[Path, ...] = ()) -> list[tuple[str, Path]]:
    """What `source` hashes, in order, each with the name it is hashed under: every .py file
    of the trainer package (relative path), then the workload's source outside it under
    `workload/` (each package directory's .py files by their path from the directory's
    parent; module files by their path from the folder they all lie in)."""
    files = [(path.relative_to(root).as_posix(), path) for path in sorted(root.rglob("*.py"))]
    modules = [source for source in workload if not source.is_dir()]
    beside = Path(os.path.commonpath([m.parent for m in modules])) if modules else None
    for source in workload:
        found, under = (sorted(source.rglob("*.py")), source.parent) if source.is_dir() else ([source], beside)
        files += [(f"workload/{path.relative_to(under).as_posix()}", path) for path in found]
    return files


def source_digest(root: Path = PACKAGE_ROOT, workload: tuple[Path, ...] = ()) -> str:
    """sha256 over `source_files` (name and content). With the default workload (inside the
    package) this is the trainer's digest alone, as it always was."""
    digest = hashlib.sha256()
    for name, path in source_files(root, workload):
        label = b"workload\0" + name.removeprefix("workload/").encode() if name.startswith("workload/") \
            else name.encode()
        digest.update(label + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def source_file_digests(root: Path = PACKAGE_ROOT, workload: tuple[Path, ...] = ()) -> dict[str, str]:
    """name -> short sha256 of each source file: kept beside `source` (not compared itself)
    so that a refused resume can name the files that changed."""
    return {name: hashlib.sha256(path.read_bytes()).hexdigest()[:16] for name, path in source_files(root, workload)}


def changed_files(old: dict | None, new: dict | None) -> str:
    """`changed a.py, b.py; added c.py; removed d.py`, or '' when either side has no file list
    (a generation written before the list was kept)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ""
    parts = []
    for verb, names in (("changed", [n for n in new if n in old and old[n] != new[n]]),
                        ("added", [n for n in new if n not in old]), ("removed", [n for n in old if n not in new])):
        if names:
            parts.append(f"{verb} {', '.join(sorted(names)[:SHOWN_FILES])}"
                         + (f" (+{len(names) - SHOWN_FILES} more)" if len(names) > SHOWN_FILES else ""))
    return "; ".join(parts)


def device_kind(device: torch.device, backend: str | None = None) -> str:
    """The device, and the process group's backend where it is not the device's own (gloo on
    CUDA: `--data-parallel-backend gloo`), since the backend's reduction order is trained bits."""
    import torch  # here, not at import: the CLI reads FIELDS for every command, most need no torch

    kind = f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
    if backend is not None and backend != ("nccl" if device.type == "cuda" else "gloo"):
        return f"{kind} over {backend}"
    return kind


def current_fingerprint(config: dict, dataset_digest: str, device: torch.device, world_size: int,
                        workload_sources: tuple[Path, ...] = (), backend: str | None = None) -> dict:
    import torch

    return {
        "source": source_digest(workload=workload_sources),
        SOURCE_FILES: source_file_digests(workload=workload_sources),
        "dataset": dataset_digest,
        "config": dict(sorted(config.items())),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "os": platform.system(),
        "arch": platform.machine(),
        "device": device_kind(device, backend),
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


def describe_diff(differences: list[tuple[str, str, object, object]], old_files: dict | None = None,
                  new_files: dict | None = None) -> str:
    """Each difference as `detail old → new`; a `source` one names the changed files when
    both fingerprints list them."""
    described = []
    for _, detail, old, new in differences:
        files = changed_files(old_files, new_files) if detail == "source" else ""
        described.append(f"{detail} {_short(old)} → {_short(new)}" + (f" ({files})" if files else ""))
    return "; ".join(described)


def check_fingerprint(generation: str, old: dict, new: dict, allowed: tuple[str, ...]) -> list[str]:
    """Raise unless every differing field is allowed; return the allowed differences
    (to be written into the attempt record and the next manifest)."""
    differences = fingerprint_diff(old, new)
    refused = [d for d in differences if d[0] not in allowed]
    if refused:
        fields = sorted({d[0] for d in refused})
        flags = " ".join(option("--allow-drift", name) for name in fields)
        raise FingerprintMismatch(
            f"{generation} was written in a different environment: "
            f"{describe_diff(refused, old.get(SOURCE_FILES), new.get(SOURCE_FILES))}; "
            f"restore that environment, or accept the change with {flags} (exactness is then not promised)")
    return [f"{detail}: {old} → {new}" for _, detail, old, new in differences]
