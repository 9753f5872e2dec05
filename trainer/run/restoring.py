"""Restore is the mirror of a save: put a verified generation back into the live state, then
continue what spans processes (an allowed config change, the cadence counters, and, going
back, the abandoned later line)."""

from __future__ import annotations

import logging

from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.onepass import DamagedShard, restore_verified
from trainer.checkpoint.restore import Restored, restore
from trainer.config import RunConfig
from trainer.errors import CorruptGeneration
from trainer.parallel.ranks import Ranks
from trainer.run.attempts import AttemptRecorder
from trainer.run.claim import Claim
from trainer.run.records import RESTORED_FROM, STORE, TIER0
from trainer.run.saving import CadencedSaves
from trainer.run.state import TrainingState
from trainer.run.checksum import safe_state_digests
from trainer.run.witness import restore_problem
from trainer.storage.base import RunStorage
from trainer.storage.memory.tier import MemoryTier
from trainer.workload import BoundWorkload

log = logging.getLogger("trainer")
ANNOUNCED = {"announce": True}
"""The restore line is said even where a user's script configured no logging (trainer/recovery/said.py)."""


class Restorer:
    def __init__(self, config: RunConfig, storage: RunStorage, memory: MemoryTier, ranks: Ranks,
                 workload: BoundWorkload):
        self.config, self.storage, self.memory, self.ranks, self.workload = config, storage, memory, ranks, workload

    def restore(self, claim: Claim, state: TrainingState, drift: tuple[str, ...], saves: CadencedSaves,
                recorder: AttemptRecorder) -> None:
        own = self.ranks.is_primary or claim.tier in TIER0  # a tier-0 claim holds this rank's own part
        generation = claim.generation if own else self.storage.local_copy(claim.generation)
        restored, tier = self.load(claim, generation, state, recorder)
        if state.progress.global_step != restored.step:
            raise CorruptGeneration(f"generation {restored.name} holds step {state.progress.global_step}, but its "
                                    f"manifest says {restored.step}; restore another one with --from-generation")
        self.check_restored_state(restored, state, drift, recorder)
        if any(change.startswith("config.") for change in drift):
            self.workload.adopt_config(state.optimizer, state.scheduler)  # an allowed --lr change takes effect
            if not self.workload.adopts_config:
                log.warning("config drift accepted, but the workload has no adopt_config: the restored optimizer "
                            "and scheduler keep the values they were saved with (e.g. the learning rate)")
        saves.load_cadence(restored.manifest.cadence)
        progress = state.progress
        saves.ledger.continue_from(restored.manifest.facts.ledger if restored.manifest.facts else None,
                                   progress.global_step, progress.epoch, progress.position)
        recorder.restored(restored, claim.verify_s)
        if tier in TIER0 and restored.manifest.facts and restored.manifest.facts.ledger:
            # No durable record holds a tier-0 generation's ledger entry: `report` counts its samples from here
            recorder.sample_ledger(restored.step, restored.manifest.facts.ledger)
        recorder.set_aside(self.ranks.decide_on_primary(lambda: self.abandon_later_line(restored.step),
                                                        "setting aside the abandoned line"))
        if not self.ranks.is_primary and self.config.from_generation is not None:
            self.memory.set_aside_later_than(restored.step)  # each rank's own tier 0
        log.info("restored %s (step=%d epoch=%d position=%d) from %s in %.3fs (%d bytes)", restored.name,
                 progress.global_step, progress.epoch, progress.position, RESTORED_FROM[tier], recorder.restore_s,
                 claim.restored_bytes, extra=ANNOUNCED)

    def load(self, claim: Claim, generation: Verification, state: TrainingState,
             recorder: AttemptRecorder) -> tuple[Restored, str]:
        """The generation into `state`, and the tier it came from. One whose shards the claim
        left unhashed (one rank, a generation on this machine's disk: `shards_pending`) is
        verified in the same read as the load. A damaged shard is then what the claim's
        separate pass would have made of it: on the run directory's disk a refusal (65, the
        same line, naming the newest earlier generation that verifies); in an object store's
        local tier the copy is removed and downloaded again (one warning, as in the claim),
        and the whole state is loaded from the download.

        Several ranks keep the separate pass (the claim hashes every file first): a damaged
        shard found by one rank's load would need every rank to agree to give up before any
        of them waits in the next collective, and a refusal in the claim is already that one
        shared decision. Tier 0 keeps it too: its fallback restores another generation (the
        durable one), which changes what the record, the lineage and the replay check were
        started with, and that is decided in the claim."""
        if not generation.shards_pending:
            return restore(generation, state, alone=claim.tier in TIER0), claim.tier
        try:
            return restore_verified(generation, state), claim.tier
        except DamagedShard as damage:
            problem = damage.problem
        fetched, download = self.storage.restorable(generation.name, self.storage.committed(), damaged=problem)
        if download.bytes:
            recorder.downloaded(download.seconds, download.bytes)
            recorder.restored_from(STORE)
        return restore(fetched, state), STORE if download.bytes else claim.tier

    def check_restored_state(self, restored: Restored, state: TrainingState, drift: tuple[str, ...],
                             recorder: AttemptRecorder) -> None:
        """The exactness witness's restore check: every rank digests what it now holds and
        compares it with what its save stored (before an allowed config change alters it).
        Another world size, device or library version lays the state out differently (other
        ranks' parts, a CUDA RNG, new optimizer defaults): not compared, and recorded why.
        A mismatch is a warning, not a refusal: the state is what the generation holds, only
        the resume is not exact, and the record and `report` say so."""
        saved = restored.manifest.facts.state_digest if restored.manifest.facts else {}
        other = [change for change in drift if not change.startswith("config.")]
        if other or len(saved) != self.ranks.world_size:
            recorder.restore_checked({}, f"allowed drift ({', '.join(other)})" if other else
                                     "the generation holds no state digest for this world size")
            return
        live = safe_state_digests(state.state_dict())
        differing = restore_problem(saved[str(self.ranks.rank)], live) if live else []
        by_rank = {rank: sections for rank, sections in enumerate(self.ranks.gather(differing, "checking the restore"))
                   if sections}
        if by_rank and self.ranks.is_primary:
            log.warning("exactness witness: %s was restored into a state other than the one saved (%s): this resume "
                        "is not exact", restored.name,
                        "; ".join(f"rank {rank}: {', '.join(sections)}" for rank, sections in by_rank.items()))
        recorder.restore_checked(by_rank)

    def abandon_later_line(self, restored_step: int) -> list[str]:
        """Rank 0, once the restore succeeded: going back with --from-generation abandons
        every later generation and export (see `set_aside_later_line`)."""
        if self.config.from_generation is None:
            return []
        abandoned = self.storage.set_aside_later_than(restored_step) + \
            self.memory.set_aside_later_than(restored_step)
        if abandoned:
            log.warning("went back to %s: set aside %d later generations and exports (%s), kept as "
                        "superseded copies", self.config.from_generation, len(abandoned), ", ".join(abandoned))
        return abandoned
