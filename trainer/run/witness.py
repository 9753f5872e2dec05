"""The exactness witness: a run checks on its own cluster that its resume was exact.

Nobody runs `compare.py` on a production job, so two checks run inside every attempt:

- Replayed steps. Every step appends its number, the bits of its loss and a checksum of the
  bits of a rotating share of the parameters (trainer/run/checksum.py) to the attempt's
  `step_digests` file (one small write into the page cache: no fsync, no collective). The loss
  alone is too blunt: a divergence by rounding can leave it unchanged for many steps, while
  any changed bit of a parameter changes the checksum at once. A resumed attempt recomputes
  the steps a lost attempt had computed past the restored generation; it compares each with
  theirs and records `replay: {matched, of, first_mismatch, against}`. It compares only
  against attempts that trained the same thing the same way (an equal fingerprint) from a
  sound restore, so an allowed drift, a world-size change or a broken restore of an earlier
  attempt is never held against it. A mismatch is one warning line naming the first step.
  A stop signal's save leaves no lost step to replay, so a stopped attempt computes one more
  step after it, records its digest (`witness_step`) and leaves without saving it: the next
  attempt replays it. A resume that still has nothing to compare (a kill -9 right at a save)
  records `replay: {compared: false, reason}`, and `report` says "not compared", never
  that every check passed.
- The restored state. Each save stores, in the signed manifest, a digest of every rank's live
  state per section (model, optim, rng, progress, …). Right after a restore each rank digests
  what it now holds: a section that differs names a restore that loaded something other than
  what was saved (a field missed, the RNGs restored before something consumed randomness).

This module reads and writes records only: `list` and `report` import it without torch.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from trainer.layout import STEP_DIGESTS
from trainer.run.records import AttemptRecord

log = logging.getLogger("trainer")
DIGEST_LENGTH = 16 + 1 + 16
"""`loss bits:checksum`, in hex."""


def step_digest(loss: float, checksum: int) -> str:
    return f"{struct.pack('>d', loss).hex()}:{checksum:016x}"


def restore_problem(saved: dict, restored: dict) -> list[str]:
    """The sections whose restored digest differs from the saved one (none: an exact restore)."""
    return sorted(name for name in set(saved) | set(restored) if saved.get(name) != restored.get(name))


class StepDigestLog:
    """Appends `step digest` per step to an attempt's `step_digests` (rank 0 only). A write
    that fails (a full disk) is said once and ends the log, never the training."""

    def __init__(self, folder: Path, persist: bool):
        self.path = folder / STEP_DIGESTS
        self.persist = persist
        self._fd: int | None = None

    def append(self, step: int, digest: str) -> None:
        if not self.persist:
            return
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(self._fd, f"{step} {digest}\n".encode())
        except OSError as error:
            log.warning("exactness witness: could not append to %s (%s); its step digests stop here",
                        self.path, error.strerror)
            self.close()
            self.persist = False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_step_digests(folder: Path, after: int = 0) -> dict[int, str]:
    """{step: digest} of one attempt, for steps past `after`; a torn last line (a kill
    mid-write) is skipped."""
    try:
        text = (folder / STEP_DIGESTS).read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    digests = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and len(parts[1]) == DIGEST_LENGTH and int(parts[0]) > after:
            digests[int(parts[0])] = parts[1]
    return digests


def comparable(record: AttemptRecord, fingerprint: dict) -> bool:
    """An earlier attempt whose steps this one must reproduce: same fingerprint (so no drift, no
    world-size change, the same reduction between them) and a restore that matched its save.
    One whose configuration cannot be exact stays comparable: a mismatch then shows what that
    configuration costs, which is what its record already warned of."""
    return record.fingerprint == fingerprint and (record.restore_check or {}).get("matched") is not False


def computed_before(records: Sequence[AttemptRecord], folder_of, fingerprint: dict, restored_step: int) -> dict[int, tuple[str, str]]:
    """{step: (digest, attempt id)} past the restored step, over the comparable earlier attempts,
    oldest first: for a step computed more than once, the newest (the one whose work was lost)."""
    computed: dict[int, tuple[str, str]] = {}
    for record in records:
        if comparable(record, fingerprint) and (record.computed_to or 0) > restored_step:
            for step, digest in read_step_digests(folder_of(record.id), after=restored_step).items():
                computed[step] = (digest, record.id)
    return computed


@dataclass
class ReplayWitness:
    """Compares this attempt's steps with what earlier attempts computed for the same steps."""

    earlier: dict[int, tuple[str, str]]
    not_compared: str | None = None
    """Why replayed steps are not expected to match (allowed drift)."""
    restored_step: int | None = None
    """The step this attempt resumed from (None: a fresh start, which has nothing to replay)."""
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
            return {"compared": False, "reason": self.not_compared}
        if not self.compared:  # a resume that trained, with nothing to hold its steps against
            return None if self.restored_step is None else {"compared": False, "reason": (
                f"no earlier attempt computed a step past step {self.restored_step} (it ended at that step's "
                f"save): forgotten loop state would not show")}
        return {"matched": self.matched, "of": self.compared, "first_mismatch": self.first_mismatch,
                "against": sorted(self.against)}


def replay_not_compared(drift: tuple[str, ...]) -> str | None:
    """Allowed drift means the resumed attempt trains differently on purpose."""
    if drift:
        return f"allowed drift ({', '.join(drift)}): replayed steps are not expected to match"
    return None
