"""Tier 0's saves (`MemorySaves`): this rank's part written alone through the same
checkpointer and commit as a durable save (`MemoryCommit`), within its budget
(storage/memory/budget.py), pruned to K, then offered to the replica's round
(storage/memory/replication.py). `NoMemorySaves` when `--memory-dir` is off."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from trainer import seams
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.commit import Committed, RenameCommit
from trainer.checkpoint.coordination import Coordinator, raise_if_any_failed
from trainer.checkpoint.manifest import GenerationFacts
from trainer.checkpoint.section import Published
from trainer.config import MemoryTierConfig
from trainer.errors import MemoryTierTooSmall, StorageFailure
from trainer.layout import generation_name, generation_step
from trainer.storage.memory.budget import OVERHEAD_BYTES, Budget, directory_bytes, state_bytes
from trainer.storage.memory.parts import RankParts
from trainer.storage.memory.replication import Replication

log = logging.getLogger("trainer")


class MemorySaves(Protocol):
    """The tier-0 saves' verbs, as the attempt calls them; each returns the tier-0 generations
    that were committed during the call."""

    def fits(self, estimate: Callable[[], int]) -> None:
        """Before the first step: refuse a start whose tier 0 cannot hold its K generations."""

    def save(self, state_dict: dict, facts: GenerationFacts, deferred=()) -> list[Published]:
        """A tier-0 generation of `state_dict` (the cadence said so); `deferred`: what only an
        optimizer step changes (`Checkpointer.defer`)."""

    def completed(self) -> list[Published]:
        """Polled after every step: what was committed in the background meanwhile."""

    def wait_for_staging(self) -> float:
        """Right before the next optimizer step: the staged copy is complete."""

    def finalize(self) -> list[Published]:
        """The attempt ends: everything in flight committed, the replica's rounds ended."""

    def close_after_failure(self) -> list[Published]:
        """After a failure: finish what is in flight; never raises."""

    def retire(self, durable: list[str]) -> None:
        """Give back what the newest of `durable` makes never restorable."""


class NoMemorySaves:
    """The saves' verbs, as the attempt calls them; each returns the tier-0 generations that
    became published during the call."""

    def fits(self, estimate: Callable[[], int]) -> None:
        return None

    def save(self, state_dict: dict, facts: GenerationFacts, deferred=()) -> list[Published]:
        return []

    def completed(self) -> list[Published]:
        return []

    def wait_for_staging(self) -> float:
        return 0.0

    def finalize(self) -> list[Published]:
        return []

    def close_after_failure(self) -> list[Published]:
        return []

    def retire(self, durable: list[str]) -> None:
        return None


class MemoryCommit(RenameCommit):
    """`RenameCommit` with the seam `memory-after-write`: a tier-0 generation's files written,
    its commit not begun (on the committer thread under async saves)."""

    def commit(self, temporary: Path, step: int, describe, digests: dict[str, dict],
               coordinator: Coordinator) -> Committed:
        seams.crash_point("memory-after-write")
        return super().commit(temporary, step, describe, digests, coordinator)


class MemoryDirSaves:
    """This attempt's tier-0 saves into this rank's parts: budget, publish, prune (the cadence
    is the run's: trainer/run/cadence.py)."""

    def __init__(self, parts: RankParts, config: MemoryTierConfig, checkpointer: Checkpointer, staging: bool,
                 coordinator: Coordinator, replicas: Replication):
        self.parts, self.config, self.checkpointer, self.staging = parts, config, checkpointer, staging
        self.coordinator = coordinator
        """Every rank's: a start refused on one rank is refused on all."""
        self.replicas = replicas
        self.failures = 0
        """Tier-0 saves that failed so far (each a warning)."""
        self.generation_bytes = 0
        """The largest tier-0 generation known (estimated, then measured)."""
        self.warned = False

    def _budget(self, estimate: int) -> Budget:
        """`estimate`: the bytes a generation of the state stores (its tensors)."""
        self.generation_bytes = max(self.generation_bytes, estimate + OVERHEAD_BYTES + estimate // 50)
        copies = 2 if self.staging else 0  # the durable saves' staging and tier 0's own
        return Budget(self.generation_bytes, self.config.keep, copies * estimate,
                      self.parts.limit_bytes(self.config.max_bytes), copies, len(self.parts.all))

    def fits(self, estimate: Callable[[], int]) -> None:
        """Before the first step: refuse a start whose tier 0 cannot hold its K generations.
        `estimate()`: the bytes a generation will store, optimizer state not created yet
        included (`TrainingState.estimated_bytes`); called only here, with tier 0 on."""
        budget, refusal = self._budget(estimate()), None
        if budget.needed > budget.limit_bytes:
            rank = f" of rank {self.parts.place.rank}" if self.parts.place.world_size > 1 else ""
            refusal = MemoryTierTooSmall(
                f"tier 0{rank} ({self.parts.own.where}) needs {budget.line()}, over its budget of {budget.limit_bytes} "
                f"bytes (--memory-tier-max-bytes, or {self.parts.share()}); raise it, lower "
                f"--memory-keep (now {budget.keep}), or drop --memory-dir")
        if self.coordinator.distributed:
            raise_if_any_failed(self.coordinator, refusal, "checking tier 0's budget")
        elif refusal is not None:
            raise refusal

    def save(self, state_dict: dict, facts: GenerationFacts, deferred=()) -> list[Published]:
        """Wait for the tier-0 save in flight (async), prune to K - 1, then write and publish
        (async: stage, and write in the background) when the new one fits; nothing pruned when
        skipped. Then a replica round (several nodes), skipped or not: every rank runs one here."""
        self.checkpointer.defer(deferred)
        published, saving = self._written(state_dict, facts)
        self.replicas.offer(generation_name(facts.step) if saving else None)
        return published

    def _written(self, state_dict: dict, facts: GenerationFacts) -> tuple[list[Published], bool]:
        """(what was published meanwhile, whether this save was made)."""
        published = self._settled(self.checkpointer.drain, facts.step)
        section, keep, name = self.parts.own.section, self.config.keep, generation_name(facts.step)
        # Those at this step or later are of a line this one replaces (after a refused tier-0
        # generation): removed, never replaced in place (that would keep a superseded copy in memory).
        earlier = [held for held in section.names() if held < name]
        doomed = [held for held in section.names() if held >= name] + earlier[:max(0, len(earlier) - (keep - 1))]
        budget = self._budget(state_bytes(state_dict))
        kept = self.parts.used_bytes() - sum(directory_bytes(section.path(name)) for name in doomed)
        replica = budget.generation_bytes * (len(self.parts.all) - 1)  # the next one received
        if kept + budget.generation_bytes + replica + budget.staging_bytes > budget.limit_bytes:
            if not self.warned:
                log.warning("tier 0 skipped step %d: %d bytes kept + %d for it + %d of staging would pass its "
                            "budget of %d bytes (the durable tiers keep their cadence)", facts.step, kept,
                            budget.generation_bytes, budget.staging_bytes, budget.limit_bytes)
                self.warned = True
            return published, False
        for name in doomed:
            section.remove(name)
        failures = self.failures
        published += self._settled(lambda: self.checkpointer.save(state_dict, facts), facts.step)
        return published, self.failures == failures  # a save that failed offers nothing to the replica

    def _settled(self, call, step: int) -> list[Published]:
        """`call()`'s published tier-0 generations, measured and logged; a storage failure (of
        this save, or of the one before it in the background) is a warning: tier 0 is a
        speed-up, its failure never ends the run."""
        try:
            published = call()
        except StorageFailure as failure:
            log.warning("tier 0 skipped a save (at step %d): %s", step, failure)
            self.failures += 1
            self.replicas.gave_up()
            return []
        for generation in published:
            self.replicas.published(generation.name)
            self.generation_bytes = max(self.generation_bytes, directory_bytes(self.parts.own.section.path(generation.name)))
            log.info("saved %s to tier 0 in %.3fs (the loop held %.3fs)", generation.name, generation.save_s,
                     generation.blocked_s)
        return published

    def completed(self) -> list[Published]:
        return self._settled(self.checkpointer.completed, -1)

    def wait_for_staging(self) -> float:
        try:
            return self.checkpointer.wait_for_staging()
        except StorageFailure as failure:  # with one process its staging failed: raised here
            log.warning("tier 0 skipped a save: %s", failure)
            self.replicas.gave_up()
            return 0.0

    def finalize(self) -> list[Published]:
        published = self._settled(self.checkpointer.finalize, -1)
        self.replicas.wait()
        return published

    def close_after_failure(self) -> list[Published]:
        self.replicas.abandon()  # its peer may be gone: never waited for
        return self.checkpointer.close_after_failure()

    def retire(self, durable: list[str]) -> None:
        """The attempt ends with everything published durable: tier-0 generations no newer than
        the newest durable one can never be restored, so their memory is given back."""
        newest = generation_step(durable[-1]) if durable else -1
        for part in self.parts.all:
            part.remove_where(lambda name: generation_step(name) <= newest)
