"""Tier 0: recovery generations in memory, outside the process (`--memory-dir`).

A directory on a memory filesystem (`/dev/shm/…` on a machine, an `emptyDir` with
`medium: Memory` in a pod) holds the newest `--memory-keep` generations, saved every
`--memory-every-steps` steps. It survives a crashed or OOM-killed process and a container
restart in the same pod; it does not survive the loss of the pod or the node, so it never
replaces the durable tiers (the run directory, the object store), which keep their cadence.

Its generations follow the same protocol as the durable ones: the same checkpointer (of the
attempt's mode) and `RenameCommit`, the same `LocalSection` (manifest last with every file's sha256, signed with
the backend's key, renamed into place), verified on load and bound to the run (`run.json`,
copied here from the run directory). A restore reads tier 0 first when it holds a generation
newer than the newest durable one that continues the line (`newer_than`); a damaged one is
refused with one warning and the durable tier serves (`restorable`). Going back
(`--from-generation`) sets later tier-0 generations aside too (removed: no superseded copies are
kept in memory).

Under async saves (`--checkpoint-mode async`; `auto` where it runs async, on CUDA) a tier-0 save
is an `AsyncCheckpointer` of its own: the loop pays its staging (a host copy into buffers of its
own, reused from save to save), and the write, the commit (manifest last, signed, renamed) and the
pruning's accounting happen in the background. Its buffers are apart from the durable saves', so
a tier-0 save in flight never holds or touches a durable one; a durable save never waits for it.
It is reported once committed (`completed`, polled after every step; at the latest the next
tier-0 save waits for it), and its failure is a warning, as in sync mode (tier 0 is for one
process for now: the CLI refuses it under torchrun). A kill during its write leaves a temporary, never selected and removed at the next
`claim`. Under sync saves it writes in the loop (`SyncCheckpointer`).

The budget (`--memory-tier-max-bytes`, default: what the memory filesystem has free) covers
the K generations and the staging buffers of async saves: two host copies of the state (the
durable saves' and tier 0's); a start that cannot fit is refused in one line (exit 2), and a
save that would not fit is skipped with a warning, never written past the budget. Every save
waits for the tier-0 save before it (one in flight) and prunes to K - 1 before writing, so K are
never exceeded even while one is being written.

`NoMemoryTier` is the same interface with nothing behind it (the option is off): the attempt
never asks which one it holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import seams
from trainer.checkpoint.atomic import write_file_durably
from trainer.checkpoint.checkpointer import Checkpointer, build_checkpointer
from trainer.checkpoint.commit import Committed, RenameCommit
from trainer.checkpoint.coordination import Coordinator
from trainer.checkpoint.identity import RunIdentity, identity_or_problem
from trainer.checkpoint.manifest import GenerationFacts, InvalidManifest, Verification, read_manifest
from trainer.checkpoint.section import LocalSection, Published
from trainer.checkpoint.signing import Signing
from trainer.config import MemoryTierConfig
from trainer.errors import MemoryTierTooSmall, StorageFailure
from trainer.layout import GENERATIONS, RunDirectory, generation_name, generation_step
from trainer.storage.lock import OutputLock

log = logging.getLogger("trainer")

OVERHEAD_BYTES = 256 * 1024
"""Allowed on top of the state's tensor bytes for a generation's index, manifest and pickled
values, until a saved generation gives its real size."""


@dataclass(frozen=True)
class Budget:
    """What tier 0 needs against what it may use."""

    generation_bytes: int
    keep: int
    staging_bytes: int
    limit_bytes: int
    staging_copies: int = 0
    """Host copies of the state the staging buffers hold (async: the durable saves' and tier 0's)."""

    @property
    def needed(self) -> int:
        return self.keep * self.generation_bytes + self.staging_bytes

    def line(self) -> str:
        copies = f" ({self.staging_copies} host copies: durable and tier-0 saves stage apart)" \
            if self.staging_copies > 1 else ""
        return (f"{self.keep} x {self.generation_bytes} bytes of generations + {self.staging_bytes} bytes of "
                f"staging{copies} = {self.needed} bytes")


def state_bytes(state_dict: dict) -> int:
    """The bytes of every tensor in a (nested) state dict: what a generation of it stores."""
    total = 0
    stack = [state_dict]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif hasattr(value, "untyped_storage") and hasattr(value, "nbytes"):
            total += int(value.nbytes)
    return total


def lazy_optimizer_bytes(optimizers) -> int:
    """Optimizer state not created yet, which `state_bytes` cannot see: most optimizers create
    theirs at the first step (Adam's exp_avg and exp_avg_sq, SGD's momentum buffer). DCP's
    `get_optimizer_state_dict` creates it for the optimizers saved under `optim`; an optimizer
    among the workload's own stateful objects (`stateful()`, saved with its plain `state_dict()`)
    keeps none until it steps. Per parameter without state: `lazy_tensors` of its size."""
    return sum(lazy_tensors(group) * int(parameter.nbytes) for optimizer in optimizers
               for group in optimizer.param_groups for parameter in group["params"] if parameter not in optimizer.state)


def lazy_tensors(group: dict) -> int:
    """Tensors of a parameter's size that an optimizer creates per parameter, from the
    hyperparameters naming the known ones: Adam-like (`betas`: exp_avg and exp_avg_sq, a third
    with `amsgrad`), RMSprop (`alpha`: square_avg, plus momentum and centered buffers), SGD
    (`momentum`: its buffer unless 0); any other: 2, as Adam (conservative for most)."""
    if "betas" in group:
        return 3 if group.get("amsgrad") else 2
    if "alpha" in group:
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    if "momentum" in group:
        return 1 if group["momentum"] else 0
    return 2


def directory_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file()) if path.is_dir() else 0


class NoMemoryTier:
    """`--memory-dir` is off: nothing newer to restore, nothing to save."""

    where = "no tier 0"

    def claim(self, held: contextlib.ExitStack) -> None:
        return None

    def newer_than(self, durable: list[str], history: list[dict], run: RunIdentity | None) -> list[str]:
        return []

    def bind(self, identity: RunIdentity) -> None:
        return None

    def restorable(self, name: str) -> Verification:
        raise AssertionError("no tier 0 holds a generation")  # newer_than named none

    def set_aside_later_than(self, step: int) -> list[str]:
        return []

    def saver(self, attempt_id: str, coordinator: Coordinator, mode: str, device: torch.device) -> "NoMemorySaves":
        return NoMemorySaves()


class NoMemorySaves:
    """The saves' verbs, as the attempt calls them; each returns the tier-0 generations that
    became published during the call."""

    def fits(self, estimate: Callable[[], int]) -> None:
        return None

    def due(self, step: int) -> bool:
        return False

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]:
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


class MemoryTier(NoMemoryTier):
    """Tier 0 in `config.directory` (see the module docstring)."""

    def __init__(self, config: MemoryTierConfig, signing: Signing | None):
        self.config = config
        self.run = RunDirectory(config.directory)
        self.section = LocalSection(self.run.section(GENERATIONS), signing)
        self.where = str(self.section.root)

    # ----------------------------------------------------------------- restoring (rank 0)
    def claim(self, held: contextlib.ExitStack) -> None:
        """Hold tier 0 with the run directory: a second trainer pointed at it is refused (73)."""
        self.section.root.mkdir(parents=True, exist_ok=True)
        held.enter_context(OutputLock(self.run.root))
        self.section.recover_interrupted_replacements()
        self.section.remove_stale_temporaries()  # held: no other writer is filling one

    def newer_than(self, durable: list[str], history: list[dict], run: RunIdentity | None) -> list[str]:
        """Tier-0 generations newer than the newest durable one that continue its line: tier 0
        is bound to this run (`run`, the run directory's identity; None: a new run directory),
        and none was written by an attempt that a later attempt went back from
        (`--from-generation` to an earlier step, perhaps without tier 0, so it could not set
        them aside)."""
        if run is None or self.bound_to() != run.run:
            return []  # another run's (or nobody's): `bind` clears them once this attempt goes ahead
        newest = generation_step(durable[-1]) if durable else -1
        went_back = [(record.get("id", ""), (record.get("restored") or {}).get("step"))
                     for record in history if record.get("explicit_generation")]
        newer = []
        for name in self.section.names():
            step = generation_step(name)
            if step <= newest:
                continue
            try:
                attempt = read_manifest(self.section.path(name)).attempt
            except InvalidManifest:
                attempt = ""  # damaged: offered, so that verifying it refuses it with its reason
            if any(later > attempt and isinstance(back, int) and back < step for later, back in went_back):
                log.info("tier 0 holds %s of an abandoned line (a later attempt went back): not restored", name)
                continue
            newer.append(name)
        return newer

    def bound_to(self) -> str | None:
        """The run tier 0 holds generations of (its `run.json`), None if none or unreadable."""
        identity, _ = identity_or_problem(self.run.identity.read_bytes() if self.run.identity.is_file() else None)
        return identity.run if identity else None

    def bind(self, identity: RunIdentity) -> None:
        """Tier 0 belongs to this run from now on: its `run.json` is the run directory's. What
        another run left here is removed (tier 0 is this machine's memory, not a durable copy:
        the flock held since `claim` says no live trainer uses it)."""
        if self.bound_to() != identity.run:
            if left := self.section.names():
                log.warning("tier 0 (%s) held generations of run %s (%s): removed, it now belongs to run %s",
                            self.where, self.bound_to(), ", ".join(left), identity.run)
            for name in left:
                self.section.remove(name)
        data = identity.to_bytes()
        if not self.run.identity.is_file() or self.run.identity.read_bytes() != data:
            write_file_durably(self.run.identity, data)

    def restorable(self, name: str) -> Verification:
        """The tier-0 generation, verified like a durable one (hash, run, signature)."""
        return self.section.verify(name)

    def set_aside_later_than(self, step: int) -> list[str]:
        """Going back: later tier-0 generations belong to the abandoned line. Removed rather
        than kept as superseded copies: memory is the scarce thing here, and the budget counts
        only what can be restored."""
        later = [name for name in self.section.names() if generation_step(name) > step]
        for name in later:
            self.section.remove(name)
        return [f"{self.where}/{name}" for name in later]

    # ----------------------------------------------------------------- saving
    def saver(self, attempt_id: str, coordinator: Coordinator, mode: str, device: torch.device) -> "MemorySaves":
        """Every rank, at the same point (an async one creates its background groups)."""
        return MemorySaves(self, build_checkpointer(mode, MemoryCommit(self.section), attempt_id, device,
                                                    coordinator), mode == "async")

    def limit_bytes(self) -> int:
        """`--memory-tier-max-bytes`, else what tier 0 holds plus what its filesystem has free."""
        if self.config.max_bytes is not None:
            return self.config.max_bytes
        stats = os.statvfs(self.section.root)
        return stats.f_bavail * stats.f_frsize + self.used_bytes()

    def used_bytes(self) -> int:
        return sum(directory_bytes(self.section.path(name)) for name in self.section.names())


class MemorySaves(NoMemorySaves):
    """This attempt's tier-0 saves: cadence, budget, publish, prune."""

    def __init__(self, tier: MemoryTier, checkpointer: Checkpointer, staging: bool):
        self.tier, self.checkpointer, self.staging = tier, checkpointer, staging
        self.generation_bytes = 0
        """The largest tier-0 generation known (estimated, then measured)."""
        self.warned = False

    def budget(self, estimate: int) -> Budget:
        """`estimate`: the bytes a generation of the state stores (its tensors)."""
        self.generation_bytes = max(self.generation_bytes, estimate + OVERHEAD_BYTES + estimate // 50)
        copies = 2 if self.staging else 0  # the durable saves' staging and tier 0's own
        return Budget(self.generation_bytes, self.tier.config.keep, copies * estimate, self.tier.limit_bytes(), copies)

    def fits(self, estimate: Callable[[], int]) -> None:
        """Before the first step: refuse a start whose tier 0 cannot hold its K generations.
        `estimate()`: the bytes a generation will store, optimizer state not created yet
        included (`TrainingState.estimated_bytes`); called only here, with tier 0 on."""
        budget = self.budget(estimate())
        if budget.needed > budget.limit_bytes:
            raise MemoryTierTooSmall(
                f"tier 0 ({self.tier.where}) needs {budget.line()}, over its budget of {budget.limit_bytes} bytes "
                f"(--memory-tier-max-bytes, or the free memory of its filesystem); raise it, lower --memory-keep "
                f"(now {budget.keep}), or drop --memory-dir")

    def due(self, step: int) -> bool:
        return step % self.tier.config.every_steps == 0

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]:
        """Wait for the tier-0 save in flight (async), prune to K - 1, then write and publish
        (async: stage, and write in the background) when the new one fits; nothing pruned when
        skipped."""
        published = self.settled(self.checkpointer.drain, facts.step)
        section, keep, name = self.tier.section, self.tier.config.keep, generation_name(facts.step)
        # Those at this step or later are of a line this one replaces (after a refused tier-0
        # generation): removed, never replaced in place (that would keep a superseded copy in memory).
        earlier = [held for held in section.names() if held < name]
        doomed = [held for held in section.names() if held >= name] + earlier[:max(0, len(earlier) - (keep - 1))]
        budget = self.budget(state_bytes(state_dict))
        kept = self.tier.used_bytes() - sum(directory_bytes(section.path(name)) for name in doomed)
        if kept + budget.generation_bytes + budget.staging_bytes > budget.limit_bytes:
            if not self.warned:
                log.warning("tier 0 skipped step %d: %d bytes kept + %d for it + %d of staging would pass its "
                            "budget of %d bytes (the durable tiers keep their cadence)", facts.step, kept,
                            budget.generation_bytes, budget.staging_bytes, budget.limit_bytes)
                self.warned = True
            return published
        for name in doomed:
            section.remove(name)
        return published + self.settled(lambda: self.checkpointer.save(state_dict, facts), facts.step)

    def settled(self, call, step: int) -> list[Published]:
        """`call()`'s published tier-0 generations, measured and logged; a storage failure (of
        this save, or of the one before it in the background) is a warning: tier 0 is a
        speed-up, its failure never ends the run."""
        try:
            published = call()
        except StorageFailure as failure:
            log.warning("tier 0 skipped a save (at step %d): %s", step, failure)
            return []
        for generation in published:
            self.generation_bytes = max(self.generation_bytes, directory_bytes(self.tier.section.path(generation.name)))
            log.info("saved %s to tier 0 in %.3fs (the loop held %.3fs)", generation.name, generation.save_s,
                     generation.blocked_s)
        return published

    def completed(self) -> list[Published]:
        return self.settled(self.checkpointer.ready, -1)

    def wait_for_staging(self) -> float:
        try:
            return self.checkpointer.wait_for_staging()
        except StorageFailure as failure:  # with one process its staging failed: raised here
            log.warning("tier 0 skipped a save: %s", failure)
            return 0.0

    def finalize(self) -> list[Published]:
        return self.settled(self.checkpointer.finalize, -1)

    def close_after_failure(self) -> list[Published]:
        return self.checkpointer.close_after_failure()

    def retire(self, durable: list[str]) -> None:
        """The attempt ends with everything published durable: tier-0 generations no newer than
        the newest durable one can never be restored, so their memory is given back."""
        newest = generation_step(durable[-1]) if durable else -1
        for name in self.tier.section.names():
            if generation_step(name) <= newest:
                self.tier.section.remove(name)
