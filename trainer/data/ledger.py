"""The sample ledger: which samples each generation's steps trained on, the data side of the
exactness witness.

Every batch reaches the loop with the ids of its samples (a map-style dataset's indices, a
stream's record numbers in the declared shard order). Each generation's manifest (sha256-
covered and signed like the rest) records, since the generation before it in its line (the
one this attempt restored, or its own previous save):

- per rank, how many samples it trained on and the sha256 of their ids in order;
- globally, the same over the global order (every rank's slice put back in place), and
  `chain`: a hash over every global micro-batch since step 0, carried across resumes, so two
  runs that trained on the same samples in the same order hold the same chain whatever their
  cadence, interruptions, worker counts or world sizes;
- the data cursor at both ends ([epoch, samples consumed in it]) and the samples trained per
  epoch, from which `report` checks that nothing was repeated or skipped between generations
  (`ledger_problems`), and `compare.py` shows two ledgers side by side;
- under `--last-batch` (trainer/data/order.py): `dropped`, the epochs that ended inside the
  entry and the samples each left untrained (`drop`: they are not in the cursors' count, so
  never "skipped"), and `padded`, the repeated samples a rank with an empty share of a last batch
  trained on at loss weight 0 (`pad`: not in the ids, not counted as samples).

The ids are gathered at each save (8 bytes a sample); rank 0 builds the global entry. Plain
Python, no torch: `report` reads ledgers without loading it.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Mapping, Sequence

GENESIS = hashlib.sha256(b"training-recovery sample ledger").hexdigest()
"""The chain before any sample (a fresh run)."""
UNKNOWN = "unknown"
"""The chain after restoring a generation written before ledgers."""


def id_bytes(ids: array) -> bytes:
    """Little-endian int64 bytes of the ids, whatever the machine."""
    if sys.byteorder == "little":
        return ids.tobytes()
    swapped = array("q", ids)
    swapped.byteswap()
    return swapped.tobytes()


class SampleLedger:
    """This rank's sample ids since the last generation, by micro-batch."""

    def __init__(self, epoch_samples: int, batch_size: int, dropped: int = 0):
        self.epoch_samples, self.batch_size, self.dropped = epoch_samples, batch_size, dropped
        self.after, self.chain, self.start = 0, GENESIS, [0, 0]
        self.micro_batches: list[array] = []
        """Kept until the next save: 8 bytes a sample."""
        self.padded = 0
        """Repeated samples trained at loss weight 0 since the last save."""

    def consumed(self, ids, padded: bool = False) -> None:
        """One micro-batch's sample ids (a tensor or a list), in order; a padded share's
        repeated sample is counted apart (its micro-batch holds no id, so the ranks' micro-
        batches stay aligned)."""
        ids = array("q", ids.tolist() if hasattr(ids, "tolist") else ids)
        if padded:
            self.padded += len(ids)
            ids = array("q")
        self.micro_batches.append(ids)

    def continue_from(self, ledger: Mapping | None, step: int, epoch: int, position: int) -> None:
        """After a restore: the next entry follows the restored generation."""
        self.after, self.start = step, self.cursor(epoch, position)
        self.chain = ledger.get("chain", UNKNOWN) if ledger else UNKNOWN
        self.micro_batches = []

    def cursor(self, epoch: int, position: int) -> list[int]:
        return [epoch, min(position * self.batch_size, self.epoch_samples)]

    def entry(self, by_rank: Sequence[list[array]], step: int, epoch: int, position: int,
              padded: Sequence[int] = ()) -> dict:
        """The manifest's `ledger` from every rank's micro-batches and padded counts (gathered,
        in rank order); it starts the next one."""
        world_size = len(by_rank)
        digest, chain = hashlib.sha256(), self.chain
        for micro in zip(*by_rank):
            placed = array("q", bytes(8 * sum(len(part) for part in micro)))
            for rank, part in enumerate(micro):
                placed[rank::world_size] = part
            data = id_bytes(placed)
            digest.update(data)
            if chain != UNKNOWN:
                chain = hashlib.sha256(bytes.fromhex(chain) + data).hexdigest()
        entry = {"after_step": self.after, "from": self.start, "to": self.cursor(epoch, position),
                 "epoch_samples": self.epoch_samples,
                 "samples": sum(len(part) for micro in by_rank for part in micro), "sha256": digest.hexdigest(),
                 "chain": chain, "by_rank": {str(rank): rank_digest(parts) for rank, parts in enumerate(by_rank)}}
        if self.dropped and epoch > self.start[0]:
            entry["dropped"] = {"per_epoch": self.dropped, "epochs": list(range(self.start[0], epoch))}
        if sum(padded):
            entry["padded"] = sum(padded)
        self.after, self.start, self.chain, self.micro_batches, self.padded = step, entry["to"], chain, [], 0
        return entry


def rank_digest(micro_batches: Sequence[array]) -> dict:
    digest = hashlib.sha256()
    for part in micro_batches:
        digest.update(id_bytes(part))
    return {"samples": sum(len(part) for part in micro_batches), "sha256": digest.hexdigest()}


def span(entry: Mapping) -> int:
    """Samples between the entry's two cursors."""
    (from_epoch, from_consumed), (to_epoch, to_consumed) = entry["from"], entry["to"]
    return (to_epoch - from_epoch) * entry["epoch_samples"] + to_consumed - from_consumed


def dropped_by_epoch(entries: Mapping[int, Mapping]) -> dict[int, int]:
    """{epoch: samples its end left untrained} over a run's ledgers (`--last-batch drop`)."""
    return {epoch: entry["dropped"]["per_epoch"] for entry in entries.values() if "dropped" in entry
            for epoch in entry["dropped"]["epochs"]}


def ledger_problems(entries: Mapping[int, Mapping]) -> list[str]:
    """What the ledgers of a run's generations ({step: ledger}) say went wrong with the data:
    an entry whose sample count is not the distance its cursors moved (samples repeated or
    skipped inside it), or whose start is not where the generation it follows ended (repeated
    or skipped between generations, across attempts included). Replayed steps (work lost with
    an attempt, done again) leave no trace here: their samples reach a generation once."""
    problems = []
    for step, entry in sorted(entries.items()):
        name = f"step {step}"
        if entry["samples"] != span(entry):
            problems.append(f"{name}: {entry['samples']} samples trained, but the cursor moved {span(entry)} "
                            f"(from {entry['from']} to {entry['to']})")
        before = entries.get(entry["after_step"])
        if before is not None and list(before["to"]) != list(entry["from"]):
            moved = span({"from": before["to"], "to": entry["from"], "epoch_samples": entry["epoch_samples"]})
            what = "skipped" if moved > 0 else "repeated"
            problems.append(f"{name}: starts at {entry['from']}, but step {entry['after_step']} ended at "
                            f"{before['to']}: {abs(moved)} samples {what}")
    return problems
