"""Saving on cadence: after each optimizer step, which save paths fire, and what every
publish leaves behind (the attempt record, an observer event, retention, the backend's
uploads).

The loop calls `after_step()` once per step with what the ranks agreed, `wait_for_staging()`
right before the next optimizer step, and `finalize()` before it ends, so every blocking
point of checkpointing stays visible in the loop. Async saves are published later than they
are taken: generations are recorded and pruned only once the checkpointer reports them
published. What happens after a publish (nothing on a local disk; an upload, or a commit
already made, in an object store) is the backend's answer (`RunStorage.after_publish`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from trainer import seams
from trainer.checkpoint.checkpointer import Checkpointer, build_checkpointer
from trainer.checkpoint.coordination import raise_if_any_failed
from trainer.checkpoint.export import full_weights, write_export
from trainer.checkpoint.manifest import GenerationFacts
from trainer.checkpoint.retention import apply_retention
from trainer.checkpoint.section import Published
from trainer.config import RunConfig
from trainer.errors import TrainerError, reraise_as_storage_failure
from trainer.layout import EXPORTS, GENERATIONS, generation_name
from trainer.parallel.ranks import Ranks, StepAgreement
from trainer.run.attempts import AttemptRecorder, utc_now
from trainer.run.records import AttemptRecord
from trainer.run.cadence import (AnyOf, AutoPrior, AutoSeconds, AutoSteps, CadenceChange, StepPoint, StepsChange,
                                 auto_prior, auto_trigger, build_policy, memory_policy, memory_prior)
from trainer.run.events import TrainingEvents
from trainer.data.order import EpochShape
from trainer.data.ledger import SampleLedger
from trainer.run.checksum import one_process_digest
from trainer.run.replicas import Replicas
from trainer.run.state import TrainingState
from trainer.storage.base import AfterPublish, Durable, RunStorage
from trainer.storage.memory.saves import MemorySaves
from trainer.storage.memory.tier import MemoryTier
from trainer.workload import Workload

log = logging.getLogger("trainer")
NOUN = {GENERATIONS: "generation", EXPORTS: "export"}


@dataclass(frozen=True)
class Lineage:
    """What every generation this attempt publishes carries in its manifest."""

    attempt_id: str
    fingerprint: dict
    allowed_drift: tuple[str, ...]
    protected: frozenset[str]
    """Generations retention must keep (the one restored)."""
    epoch: EpochShape = EpochShape(0, 1)
    """An epoch's batches: the sample ledger's cursors count its trained samples, and its
    entries the dropped ones (trainer/data/ledger.py)."""
    history: tuple[AttemptRecord, ...] = ()
    """The earlier attempts' records (`Claim.history`): what the auto cadences start from."""


@dataclass(frozen=True)
class SaveTargets:
    """Where the saves go: the run directory's backend and tier 0 beside it (`storage/opening.py`)."""

    storage: RunStorage
    memory: MemoryTier


@dataclass(frozen=True)
class Witnesses:
    """Who hears of every publish: the attempt record and the observer (Polyaxon)."""

    recorder: AttemptRecorder
    events: TrainingEvents


def cadence_changed(ranks: Ranks, recorder: AttemptRecorder, change: CadenceChange | StepsChange, step: int | None,
                    key: str = "cadence_changes") -> None:
    """An auto interval changed: one line (rank 0) and an entry of the attempt record's `key`."""
    if ranks.is_primary:
        log.info("%s", change.line())
    recorder.cadence_changed(change.as_record(step, recorder.elapsed_s()), key)


class MemoryCadence:
    """When tier 0 saves: every `--memory-every-steps` N (`memory_policy`), or `auto`
    (trainer/run/cadence.py `AutoSteps`: Daly's interval for tier 0's measured C, in steps,
    bounded by `--memory-auto-min-secs`/`--memory-auto-max-secs`). Rank 0 decides, in the
    step's agreement; each change of N is one line and an entry of `memory_cadence_changes`."""

    def __init__(self, config: RunConfig, ranks: Ranks, recorder: AttemptRecorder, prior: Callable[[], AutoPrior]):
        self.ranks, self.recorder = ranks, recorder
        settings, self.auto = config.memory, None
        self.fixed = memory_policy(settings)
        if settings.directory is not None and settings.auto is not None:
            self.auto = AutoSteps(AutoSeconds(settings.auto, prior() if ranks.is_primary else AutoPrior()))

    def due(self, point: StepPoint) -> bool:
        """Rank 0 only (`CadencedSaves.votes`)."""
        if self.auto is None:
            return self.fixed.due(point)
        due, change = self.auto.due(point.step)
        if change is not None:
            cadence_changed(self.ranks, self.recorder, change, point.step, "memory_cadence_changes")
        return due

    def saved(self, step: int) -> None:
        """A tier-0 or a durable save was made at `step` (every rank)."""
        if self.auto is not None:
            self.auto.saved(step)

    def published(self, published_now: list[Published], step: int | None = None) -> None:
        """Tier-0 generations published: recorded (flushed) one by one; with auto, each one's
        blocked seconds re-derive N (`step`: the loop's step now; None: the attempt ends)."""
        for published in published_now:
            self.recorder.memory_saved(published)
            seams.crash_point("after-memory-save")
            if self.auto is not None and step is not None and (change := self.auto.measured(published.blocked_s, step)):
                cadence_changed(self.ranks, self.recorder, change, step, "memory_cadence_changes")


class SavePath(Protocol):
    """One save path as `CadencedSaves` drives it: the durable one (`DurablePath`) and tier 0
    (`Tier0Path`) answer the same verbs. Each hands what its saver published during the call to
    whoever hears of it (the attempt record, retention, its auto cadence)."""

    def due(self, agreed: StepAgreement, final: bool) -> bool:
        """Whether it saves after this step (rank 0's policy decided it: `Ranks.start_agreement`)."""

    def save(self, state: TrainingState, ledger: SampleLedger, facts: Facts) -> None:
        """A generation of `state`; `facts(state, state_dict, ledger)` says what its manifest says."""

    def committed(self, step: int) -> None:
        """Polled after every step: what committed in the background meanwhile."""

    def wait_for_staging(self) -> float:
        """Right before the next optimizer step: the staged copy is complete; the seconds waited."""

    def defer(self, tensors: list, share: tuple[int, int]) -> None:
        """`tensors` change only in an optimizer step; `share`: they are replicas (`Checkpointer.defer`)."""

    def finalize(self, step: int) -> None:
        """The attempt ends: everything in flight published."""

    def close_after_failure(self, peers_lost: bool) -> None:
        """After a failure: finish what is in flight (unless it waits on a lost peer); never raises."""


Facts = Callable[..., GenerationFacts]
"""`facts(state, state_dict, ledger, digest_later=False)` (`CadencedSaves.facts`)."""


class DurablePath:
    """Recovery generations through the checkpointer, on the recovery cadence, at the end and
    on a stop signal. What an async save published is learned at its next save or at the end,
    where the ranks agree on it (never polled). Its uploads are agreed on before each save and
    drained when it ends (`CadencedSaves.agree_on_uploads`, `drain_uploads`)."""

    def __init__(self, checkpointer: Checkpointer, policy: AnyOf, heard: Callable[..., None],
                 uploads: tuple[Callable[[], None], Callable[[], None]], ledger_entries: dict[str, dict]):
        self.checkpointer, self.policy, self.heard = checkpointer, policy, heard
        (self.agree_on_uploads, self.drain_uploads), self.ledger_entries = uploads, ledger_entries

    def due(self, agreed: StepAgreement, final: bool) -> bool:
        return agreed.recover or final or agreed.preempt

    def save(self, state: TrainingState, ledger: SampleLedger, facts: Facts) -> None:
        """`ledger` moves on: the next generation covers the samples since this one."""
        self.agree_on_uploads()
        state_dict = state.state_dict()
        made = facts(state, state_dict, ledger, True)  # the checkpointer digests what it saves (async: off the loop)
        self.ledger_entries[generation_name(made.step)] = made.ledger
        self.heard(self.checkpointer.save(state_dict, made), state.progress.global_step)
        self.policy.saved()

    def committed(self, step: int) -> None:
        return None

    def wait_for_staging(self) -> float:
        return self.checkpointer.wait_for_staging()

    def defer(self, tensors: list, share: tuple[int, int]) -> None:
        self.checkpointer.defer(tensors, share)

    def finalize(self, step: int) -> None:
        self.heard(self.checkpointer.finalize(), step)
        self.checkpointer.local.settle()  # retention deletes beside the loop; done when the attempt ends
        self.drain_uploads()

    def close_after_failure(self, peers_lost: bool) -> None:
        self.heard(self.checkpointer.committed_without_peers() if peers_lost else
                   self.checkpointer.close_after_failure(), None, prune=False)
        self.checkpointer.local.settle()


class Tier0Path:
    """Tier-0 generations (`MemorySaves`) on tier 0's cadence (`MemoryCadence`), polled after
    every step; where a durable save fires it is skipped."""

    def __init__(self, saves: MemorySaves, cadence: MemoryCadence):
        self.saves, self.cadence = saves, cadence
        self.deferred: list = []

    def due(self, agreed: StepAgreement, final: bool) -> bool:
        return agreed.memory

    def save(self, state: TrainingState, ledger: SampleLedger, facts: Facts) -> None:
        """The ledger entry is taken from a copy: the next durable generation still covers every
        sample since the previous durable one."""
        state_dict = state.state_dict()
        # One process: its digest is the checkpointer's, from the staged copy (async: off the loop).
        made = facts(state, state_dict, copy.copy(ledger), True)
        self.cadence.published(self.saves.save(state_dict, made, self.deferred), state.progress.global_step)

    def committed(self, step: int) -> None:
        self.cadence.published(self.saves.completed(), step)

    def wait_for_staging(self) -> float:
        return self.saves.wait_for_staging()

    def defer(self, tensors: list, share: tuple[int, int]) -> None:
        self.deferred = tensors  # each rank's tier-0 part holds the whole state: no share

    def finalize(self, step: int) -> None:
        self.cadence.published(self.saves.finalize())  # the attempt ends: no re-derivation

    def close_after_failure(self, peers_lost: bool) -> None:
        self.cadence.published(self.saves.close_after_failure())  # no tier-0 writer outlives the attempt


class StepGuard:
    """Where the loop waits for an async save's staged copy: right before the optimizer step
    that changes what was staged (a step pre-hook on every optimizer), not right after the
    save. The copy of the parameters and the optimizer's state (what only that step changes)
    then runs beside the next forward and backward; everything else is copied before the save
    returns (`ReusableStager.defer`). Armed only when every optimizer takes a step pre-hook (a
    `torch.optim.Optimizer`, unwrapped from Accelerate's or Lightning's wrapper); otherwise the
    loop's own `wait_for_staging()` blocks, as before."""

    def __init__(self, paths: tuple[SavePath, ...], recorder: AttemptRecorder, share: tuple[int, int] = (0, 1)):
        """`share` (rank, world size): the parameters and optimizer state are replicas (DDP)."""
        self.paths, self.recorder, self.share = paths, recorder, share
        self.hooks: list = []

    @property
    def armed(self) -> bool:
        return bool(self.hooks)

    def wait_for_staging(self) -> None:
        """The loop's wait: taken here unless the optimizers' hooks take it before their step."""
        if not self.armed:
            self.staged()

    def staged(self) -> None:
        """Every path's staged copy is safe from the state's next change (`Checkpointer.wait_for_staging`)."""
        self.recorder.waited(sum(path.wait_for_staging() for path in self.paths))

    def arm(self, state: TrainingState) -> None:
        """Before a save: every path told what only an optimizer step changes, once the wait
        is hooked into every optimizer's step (nothing when one cannot be hooked)."""
        deferred = self.guarded(state)
        for path in self.paths:
            path.defer(deferred, self.share)

    def guarded(self, state: TrainingState) -> list:
        """The tensors only an optimizer step changes, once its wait is hooked in; [] when
        some optimizer cannot be hooked (nothing is deferred then). Every torch optimizer of a
        wrapper chain is hooked (a Lookahead's own step changes the parameters too)."""
        chains = [wrapped(optimizer) for optimizer in state.optimizers()]
        if not chains or not all(isinstance(chain[-1], torch.optim.Optimizer) for chain in chains):
            return []
        levels = [level for chain in chains for level in chain if hasattr(level, "_optimizer_step_pre_hooks")]
        if not self.armed:
            self.hooks = [level.register_step_pre_hook(lambda *step: self.staged()) for level in levels]
        return [*state.model.parameters(),
                *(value for level in levels for per_parameter in level.state.values()
                  for value in per_parameter.values() if isinstance(value, torch.Tensor))]

    def release(self) -> None:
        """The attempt ends: the user's optimizers are theirs again."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def wrapped(optimizer) -> list:
    """A framework's optimizer wrapper (Accelerate's `optimizer`, Lightning's `_optimizer`)
    and what it wraps, outermost first: the last is the torch optimizer."""
    chain = [optimizer]
    while (inner := getattr(chain[-1], "optimizer", getattr(chain[-1], "_optimizer", None))) is not None:
        chain.append(inner)
    return chain


class CadencedSaves:
    def __init__(self, config: RunConfig, targets: SaveTargets, lineage: Lineage, ranks: Ranks, witnesses: Witnesses,
                 mode: str):
        """Every rank builds its durability and the checkpointer (`mode`: sync or async) that writes
        through its commit, and the guard of its optimizers, at the same point (an async one creates groups)."""
        self.config, self.lineage, self.ranks = config, lineage, ranks
        self.recorder, self.events = witnesses.recorder, witnesses.events
        self.durability = targets.storage.durability(lineage.protected, self.recorder.folder, ranks.is_primary)
        self.checkpointer: Checkpointer = build_checkpointer(mode, self.durability.commit(), lineage.attempt_id,
                                                             ranks.device, ranks)
        self.memory = targets.memory.saver(lineage.attempt_id, ranks, mode, ranks.device)  # tier 0's, same mode
        self.tier0 = MemoryCadence(config, ranks, self.recorder, lambda: memory_prior(lineage.history,
                                                                                      lineage.attempt_id))
        self.ledger = SampleLedger(lineage.epoch.trained, config.workload.batch_size, lineage.epoch.dropped)
        """The samples trained on since the last generation, for the next one's manifest."""
        self.ledger_entries: dict[str, dict] = {}
        """Saved generations' ledgers, recorded in the attempt record once published."""
        self.sections = {GENERATIONS: self.checkpointer.local, EXPORTS: targets.storage.section(EXPORTS)}
        self.recover_policy = build_policy(config.recover, prior=auto_prior(
            lineage.history, lineage.attempt_id) if config.recover.auto and ranks.is_primary else None)
        self.auto = auto_trigger(self.recover_policy)
        """`--recover-every-secs auto`: re-derived after every recovery save (rank 0 decides)."""
        if self.auto is not None:
            cadence_changed(ranks, self.recorder, self.auto.current, None)
        self.durable = DurablePath(self.checkpointer, self.recover_policy, self.record_generations,
                                   (self.agree_on_uploads, self.drain_uploads), self.ledger_entries)
        self.paths: tuple[SavePath, ...] = (self.durable, Tier0Path(self.memory, self.tier0))
        """Where both are due after a step, the first saves."""
        self.export_policy = build_policy(config.export)
        self.sharded = config.workload.data_parallel == "fsdp"  # FSDP2 in one process too (a group of one)
        self.replicas = Replicas(ranks, self.sharded)  # an unsharded model must be one model on every rank
        self.guard = StepGuard(self.paths, self.recorder, (0, 1) if self.sharded else (ranks.rank, ranks.world_size))
        self.upload_failure: TrainerError | None = None
        """Rank 0's background upload failure, held for the next point where every rank agrees."""

    @property
    def generations(self):
        """This machine's generations (a direct checkpointer's scratch holds none)."""
        return self.sections[GENERATIONS]

    def load_cadence(self, cadence: dict) -> None:
        """Continue the cadence counters a restored generation carried."""
        self.recover_policy.load_state(cadence.get("recover", {}))
        self.export_policy.load_state(cadence.get("export", {}))

    def votes(self, point: StepPoint) -> tuple[bool, bool, bool]:
        """Rank 0's votes (recover, export, tier 0) for `point`, after the step before it saved."""
        return self.recover_policy.due(point), self.export_policy.due(point), self.tier0.due(point)

    def wait_for_staging(self) -> None:
        """Every path's staged copy is safe before the state changes (or, `StepGuard`, before its step)."""
        self.guard.wait_for_staging()

    def after_step(self, state: TrainingState, model: nn.Module, workload: Workload, agreed: StepAgreement,
                   final: bool) -> None:
        self.record_durable(self.completed())
        for path in self.paths:
            path.committed(state.progress.global_step)
        if (due := next((path for path in self.paths if path.due(agreed, final)), None)) is not None:
            self.save(due, state)
        if agreed.export or final:
            self.save_export(state, model, workload)

    def completed(self) -> tuple[Durable, ...]:
        """What became durable since the last step (see `held_for_every_rank`)."""
        return self.held_for_every_rank(self.durability.completed, ())

    def held_for_every_rank(self, call, nothing):
        """`call()`, with rank 0's background upload failure (exports, tiered saves) held under
        torchrun: with one process it ends the attempt at once; with several it waits for the
        next save or the end, where every rank learns of it (a rank that stopped alone would
        leave the others waiting in a collective)."""
        try:
            return call()
        except TrainerError as failure:
            if not self.ranks.distributed:
                raise
            self.upload_failure = self.upload_failure or failure
            return nothing

    def agree_on_uploads(self) -> None:
        """Every rank raises rank 0's background upload failure, if there was one."""
        if self.ranks.distributed:
            raise_if_any_failed(self.ranks, self.upload_failure, "uploading to the object store")

    def save_generation(self, state: TrainingState) -> None:
        self.save(self.durable, state)
        self.guard.staged()  # `run.save()`: the state may change once it returns

    def save(self, path: SavePath, state: TrainingState) -> None:
        self.guard.arm(state)
        path.save(state, self.ledger, self.facts)
        self.tier0.saved(state.progress.global_step)  # a durable save is as new as a tier-0 one

    def facts(self, state: TrainingState, state_dict: dict, ledger: SampleLedger,
              digest_later: bool = False) -> GenerationFacts:
        """What a generation's manifest says besides its files (`ledger` gives its entry and moves on);
        `digest_later`: one process leaves the state digest to the checkpointer (`GenerationFacts`)."""
        progress, later = state.progress, digest_later and not self.ranks.distributed
        mine = (ledger.micro_batches, ledger.padded)  # one gather for both: the digests and the ledger
        digests, ledgers = ([], [mine]) if later else self.replicas.state_digests(state_dict, state.model,
                                                                                  progress.global_step, mine)
        samples, padded = zip(*ledgers)
        return GenerationFacts(progress.global_step, progress.epoch, progress.position, self.lineage.fingerprint,
                               self.lineage.allowed_drift, {"recover": {}, "export": self.export_policy.state()},
                               utc_now(), {str(rank): digest for rank, digest in enumerate(digests)}
                               if digests and all(digests) else {},
                               ledger.entry(samples, progress.global_step, progress.epoch, progress.position, padded),
                               one_process_digest if later else None)

    def save_export(self, state: TrainingState, model: nn.Module, workload: Workload) -> None:
        """Every rank: rank 0 writes the export (under FSDP all gather the weights first); its failure reaches all."""
        progress = state.progress
        weights = full_weights(model, self.sharded) if self.ranks.is_primary or self.sharded else {}

        def export() -> None:
            published = write_export(self.sections[EXPORTS], weights, progress.global_step, progress.epoch,
                                     workload.architecture(), self.config.export_dtype,
                                     self.lineage.fingerprint["source"], self.lineage.attempt_id)
            self.export_policy.saved()
            self.published(EXPORTS, published, progress.global_step)
            self.apply_retention(EXPORTS)
        self.on_primary(export, f"writing export {generation_name(progress.global_step)}")

    def on_primary(self, act: Callable[[], None], what: str) -> None:
        """The lock holder's own work (the export, retention) on rank 0, as a decision every rank shares: its failure
        reaches every rank at once (rank 0's line and status), not rank 0 alone. Every rank calls it at one point."""
        def acted() -> None:
            try:
                act()
            except TrainerError:
                raise  # already one line with its status (a store that stopped answering: 74)
            except Exception as error:  # noqa: BLE001 - an I/O error becomes one line, 74
                reraise_as_storage_failure(error, what)
        self.ranks.decide_on_primary(acted, what)

    def finalize(self, step: int) -> None:
        """Every path drains its save in flight (it publishes), the durable one its uploads (they make it durable)."""
        self.guard.release()
        for path in self.paths:
            path.finalize(step)
        newest = self.generations.names()[-1:] + [self.recorder.newest_generation or ""]  # the record's: no local copy
        self.memory.retire(sorted(name for name in newest if name)[-1:])  # older: never restored (none durable: none)

    def drain_uploads(self) -> None:
        """The durable path ends: what is published becomes durable, and every rank learns of a failure."""
        self.record_durable(self.held_for_every_rank(self.durability.drain, ()))
        self.agree_on_uploads()
        self.durability.close()

    def close_after_failure(self, peers_lost: bool = False) -> None:
        """After a failure: each path ends what is in flight (unless it waits on a lost peer), then uploads drain."""
        self.guard.release()
        for path in self.paths:
            path.close_after_failure(peers_lost)
        try:  # what is published may still become durable
            self.record_durable([] if peers_lost else self.durability.drain())
        except Exception as error:  # noqa: BLE001 - the original failure is what ends the attempt
            log.warning("an upload failed too: %s", error)
        self.durability.close()

    def record_generations(self, published_now: list[Published], step: int | None, prune: bool = True) -> None:
        for published in published_now:
            self.published(GENERATIONS, published, step)
            if self.auto is not None and (change := self.auto.measured(published.blocked_s)):
                cadence_changed(self.ranks, self.recorder, change, published.step)
            if prune:  # retention is the lock holder's job
                self.on_primary(lambda: self.apply_retention(GENERATIONS), "applying retention")

    def published(self, kind: str, published: Published, step: int | None) -> None:
        self.recorder.published(kind, published, step,
                                self.ledger_entries.pop(published.name, {}) if kind == GENERATIONS else None)
        self.events.published(NOUN[kind], self.sections[kind].path(published.name), published)
        after: AfterPublish = self.held_for_every_rank(
            lambda: self.durability.after_publish(kind, published, self.sections[kind].path(published.name)),
            AfterPublish())
        self.record_durable(after.durable)
        if after.durable:
            self.durability.recorded(self.recorder.folder)
        for name in after.removed:
            self.events.removed(NOUN[kind], name)
        self.recorder.waited(after.waited_s)
        log.info("published %s %s in %.3fs", NOUN[kind], published.name, published.save_s)

    def record_durable(self, durable: tuple[Durable, ...]) -> None:
        for done in durable:
            self.recorder.durable(done.kind, done.name, done.upload_s, done.durable_s)
            self.events.durable(NOUN[done.kind], done.name)
            log.info("durable %s %s in %.3fs (upload %.3fs, %d bytes)", NOUN[done.kind], done.name, done.durable_s,
                     done.upload_s, done.bytes)

    def apply_retention(self, kind: str) -> None:
        """Local retention never deletes what is not durable yet, the newest durable one, or the one restored."""
        retention = self.config.retention
        keep_last, keep_every = ((retention.keep_last, retention.keep_every) if kind == GENERATIONS
                                 else (retention.keep_exports, None))
        kept = self.durability.kept_locally(kind) | (self.lineage.protected if kind == GENERATIONS else frozenset())
        for name in apply_retention(self.sections[kind], keep_last, keep_every, kept, later=kind == GENERATIONS):
            log.info("retention removed %s %s", NOUN[kind], name)
            self.events.removed(NOUN[kind], name)
