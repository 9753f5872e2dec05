"""The exactness witness: a run checks on its own cluster that its resume was exact.

Nobody runs `compare.py` on a production job, so two checks run inside every attempt:

- Replayed steps. Every step appends its number, the bits of its loss and a checksum of the
  bits of every parameter rank 0 holds to the attempt's `step_digests` file (one small write
  into the page cache: no fsync, no collective). The loss alone is too blunt: a divergence by
  rounding can leave the printed loss unchanged for many steps, while any changed bit of any
  parameter changes the checksum at once. A
  resumed attempt recomputes the steps a lost attempt had already computed past the restored
  generation; it compares each of its own with theirs and records `replay: {matched, of,
  first_mismatch}`. A mismatch is one warning line naming the first differing step.
- The restored state. Each save stores, in the signed manifest, a digest of every rank's live
  state per section (model, optim, rng, progress, …). Right after a restore each rank digests
  what it now holds: a section that differs names a restore that loaded something other than
  what was saved (a field missed, the RNGs restored before something consumed randomness).

Digests are sha256 over the raw bytes of each tensor (this rank's local shard of a DTensor),
in key order, and over the repr of plain values: equal states give equal digests on the same
machine, whatever process computed them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from trainer.layout import STEP_DIGESTS

log = logging.getLogger("trainer")
DIGEST_CHARS = 16
"""Hex characters kept of each section's sha256: 64 bits tell a wrong restore apart."""


# ----------------------------------------------------------------------------- checksums
BLOCK_WORDS = 4096
"""Words per block of `tensor_checksum`: elements that trade places across blocks change it."""


def tensor_checksum(tensor):
    """A 0-dim int64 tensor on the tensor's device: its bytes as 64-bit words, summed per block
    of BLOCK_WORDS with wrap-around, the block sums weighted by their place. Integer sums are
    exact, so any changed bit changes it; it reads the bytes once at memory speed (a sha256 of
    the same bytes runs at a tenth of that on a CPU), and needs no copy to the host."""
    import torch  # here: the attempt record imports this module, and `list`/`report` never load torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    words = raw[:whole].view(torch.int64)
    full = words.numel() // BLOCK_WORDS * BLOCK_WORDS
    blocks = words[:full].view(-1, BLOCK_WORDS).sum(1)
    places = torch.arange(1, blocks.numel() + 3, dtype=torch.int64, device=raw.device)
    return (blocks * places[:-2]).sum() + words[full:].sum() * places[-2] + raw[whole:].to(torch.int64).sum() * places[-1]


def local_part(tensor):
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# ----------------------------------------------------------------------------- the state
def state_digests(state_dict: dict) -> dict[str, str]:
    """{top-level section: digest} of a state dict as this rank holds it: every tensor's key,
    dtype, shape and checksum, and every plain value's repr, in key order."""
    entries: list[tuple[str, object]] = []
    _flatten("", state_dict, entries)
    checksums = _checksums([value for _, value in entries])
    sections: dict = {}
    for (key, value), checksum in zip(entries, checksums):
        sha = sections.setdefault(key.split(".", 1)[0], hashlib.sha256())
        described = repr(value) if checksum is None else f"{value.dtype}{tuple(value.shape)}:{checksum}"
        sha.update(f"{key}={described};".encode())
    return {name: sha.hexdigest()[:DIGEST_CHARS] for name, sha in sorted(sections.items())}


def _flatten(prefix: str, value, entries: list) -> None:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            _flatten(f"{prefix}{key}.", value[key], entries)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _flatten(f"{prefix}{index}.", item, entries)
    else:
        entries.append((prefix.rstrip("."), value))


def _checksums(values: list) -> list:
    """Each tensor's checksum (None for other values), with one host synchronisation per device."""
    import torch

    tensors = [(index, local_part(value)) for index, value in enumerate(values) if isinstance(value, torch.Tensor)]
    found: list = [None] * len(values)
    by_device: dict = {}
    for index, tensor in tensors:
        by_device.setdefault(tensor.device, []).append((index, tensor_checksum(tensor)))
    for pairs in by_device.values():
        for (index, _), checksum in zip(pairs, torch.stack([c for _, c in pairs]).tolist()):
            found[index] = checksum
    return found


def restore_problem(saved: dict, restored: dict) -> list[str]:
    """The sections whose restored digest differs from the saved one (none: an exact restore)."""
    return sorted(name for name in set(saved) | set(restored) if saved.get(name) != restored.get(name))


# ----------------------------------------------------------------------------- the steps
def parameter_checksum(model) -> int:
    """Every parameter this rank holds (its shard of a DTensor), each by `tensor_checksum`,
    weighted by its place: one read of the parameters, one host synchronisation."""
    import torch

    sums = [tensor_checksum(local_part(parameter)) for parameter in model.parameters()]
    values = torch.stack(sums).tolist() if sums else []
    return sum((place + 1) * value for place, value in enumerate(values)) % 2**64


DIGEST_LENGTH = 16 + 1 + 16


def step_digest(loss: float, checksum: int) -> str:
    return f"{struct.pack('>d', loss).hex()}:{checksum:016x}"


class StepDigestLog:
    """Appends `step loss-bits:checksum` per step to an attempt's `step_digests` (rank 0 only)."""

    def __init__(self, folder: Path, persist: bool):
        self.path = folder / STEP_DIGESTS
        self.persist = persist
        self._fd: int | None = None

    def append(self, step: int, digest: str) -> None:
        if not self.persist:
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._fd, f"{step} {digest}\n".encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_step_digests(folder: Path) -> dict[int, str]:
    """{step: digest} of one attempt; a torn last line (a kill mid-write) is skipped."""
    try:
        text = (folder / STEP_DIGESTS).read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    digests = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and len(parts[1]) == DIGEST_LENGTH:
            digests[int(parts[0])] = parts[1]
    return digests


def computed_before(attempt_folders: list[Path]) -> dict[int, tuple[str, str]]:
    """{step: (digest, attempt id)} over earlier attempts, oldest first: for a step
    computed more than once, the newest attempt that computed it (the one whose work was lost)."""
    computed: dict[int, tuple[str, str]] = {}
    for folder in attempt_folders:
        for step, bits in read_step_digests(folder).items():
            computed[step] = (bits, folder.name)
    return computed


@dataclass
class ReplayWitness:
    """Compares this attempt's steps with what earlier attempts computed for the same steps."""

    earlier: dict[int, tuple[str, str]]
    not_compared: str | None = None
    """Why replayed steps are not expected to match (a world-size change, allowed drift)."""
    matched: int = 0
    compared: int = 0
    first_mismatch: int | None = None
    against: set[str] = field(default_factory=set)

    def step(self, step: int, digest: str) -> bool:
        """Check one step; True when it is the first mismatch (the caller records it at once)."""
        if self.not_compared is not None or step not in self.earlier:
            return False
        earlier, attempt = self.earlier[step]
        self.compared += 1
        self.against.add(attempt)
        if earlier == digest:
            self.matched += 1
            return False
        if self.first_mismatch is not None:
            return False
        self.first_mismatch = step
        what = "its loss" if earlier.split(":")[0] != digest.split(":")[0] else "its parameters (the loss still agrees)"
        log.warning("exactness witness: replayed step %d differs from what attempt %s computed, in %s: this resume "
                    "is not exact; `report` shows it per attempt", step, attempt, what)
        return True

    def as_record(self) -> dict | None:
        """`replay` of the attempt record (None: this attempt replayed nothing)."""
        if self.not_compared is not None:
            return {"compared": False, "reason": self.not_compared} if self.earlier else None
        if not self.compared:
            return None
        return {"matched": self.matched, "of": self.compared, "first_mismatch": self.first_mismatch,
                "against": sorted(self.against)}


def replay_not_compared(drift: tuple[str, ...]) -> str | None:
    """Allowed drift means the resumed attempt trains differently on purpose."""
    if drift:
        return f"allowed drift ({', '.join(drift)}): replayed steps are not expected to match"
    return None
