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


# ----------------------------------------------------------------------------- the state
def state_digests(state_dict: dict) -> dict[str, str]:
    """{top-level section: digest} of a state dict as this rank holds it."""
    return {name: _digest(value) for name, value in sorted(state_dict.items())}


def _digest(value) -> str:
    sha = hashlib.sha256()
    _feed(sha, value)
    return sha.hexdigest()[:DIGEST_CHARS]


def _feed(sha, value) -> None:
    import torch  # here: the attempt record imports this module, and `list`/`report` never load torch

    if isinstance(value, dict):
        for key in sorted(value, key=str):
            sha.update(f"<{key!s}>".encode())
            _feed(sha, value[key])
    elif isinstance(value, (list, tuple)):
        sha.update(f"[{len(value)}".encode())
        for item in value:
            _feed(sha, item)
    elif isinstance(value, torch.Tensor):
        tensor = value.to_local() if hasattr(value, "to_local") else value  # this rank's shard of a DTensor
        tensor = tensor.detach().cpu().contiguous()
        sha.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.numel():
            sha.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    else:
        sha.update(repr(value).encode())


def restore_problem(saved: dict, restored: dict) -> list[str]:
    """The sections whose restored digest differs from the saved one (none: an exact restore)."""
    return sorted(name for name in set(saved) | set(restored) if saved.get(name) != restored.get(name))


# ----------------------------------------------------------------------------- the steps
def parameter_checksum(model) -> int:
    """The bits of every parameter this rank holds (its shard of a DTensor), summed as
    integers, each parameter weighted by its place: exact on any device, one read of the
    parameters, one host synchronisation. Any changed bit changes it; elements that trade
    places inside one parameter do not (a restore that did that is the state digest's to see)."""
    import torch

    sums = []
    for parameter in model.parameters():
        tensor = parameter.detach()
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if tensor.numel():
            as_integers = INTEGER_OF_SIZE[tensor.element_size()]
            sums.append(tensor.contiguous().view(getattr(torch, as_integers)).sum(dtype=torch.int64))
    values = torch.stack(sums).tolist() if sums else []
    return sum((place + 1) * value for place, value in enumerate(values)) % 2**64


INTEGER_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
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
