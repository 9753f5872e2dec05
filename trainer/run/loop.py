"""The training run, top to bottom:

    claim the output → choose what to restore → build the state → restore it → train →
    save and export on cadence → record the attempt → end

Under torchrun every rank runs this same flow. Rank 0 alone claims the output, chooses and
verifies the generation, checks the fingerprint, publishes, exports and records the attempt;
`self.ranks` hands its results (or its error) to the other ranks (see trainer/parallel/ranks.py).

Every blocking point of checkpointing is visible in `train()`: `saves.after_step()` after a
step the cadence picked, `saves.wait_for_staging()` right before the next optimizer step,
`saves.finalize()` before the end.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from trainer.run.attempts import (COMPLETED, FAILED, INTERRUPTED, PREEMPTED, AttemptRecorder, new_attempt_id,
                              previous_attempt, read_attempts, refuse_crash_loop, steps_replayed, world_size_change)
from trainer.run.batching import EpochBatchOrder, require_even_split
from trainer.run.cadence import StepPoint
from trainer.config import RunConfig
from trainer.parallel.ranks import Ranks, process_group, unshared_output
from trainer.errors import (EXIT_INTERRUPTED, EXIT_OK, CorruptGeneration, CrashLoop, FingerprintMismatch,
                            TrainerError, UntrustedGeneration)
from trainer.run.events import TrainingEvents
from trainer.run.fetching import KeyedSeeding, epoch_loader
from trainer.run.fingerprint import check_fingerprint, current_fingerprint
from trainer.parallel.launch import LaunchEnvironment
from trainer.storage.lock import OutputLock
from trainer.run.preemption import PreemptionGuard, ignore_late_stop_requests
from trainer.run.progress import Progress
from trainer.checkpoint.atomic import manifest_digest
from trainer.checkpoint.checkpointer import build_checkpointer, effective_mode
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.restore import restore
from trainer.checkpoint.resume import choose_candidate, set_aside_later_line, verify_candidate
from trainer.checkpoint.section import LocalSection
from trainer.checkpoint.signing import load_signing
from trainer.storage.object.section import Transfer
from trainer.layout import RunDirectory
from trainer.run.runtime import configure_determinism, resolve_device
from trainer.run.saving import CadencedSaves, Lineage
from trainer.run.state import TrainingState
from trainer.run.stepping import OptimizerSteps
from trainer.storage.object.backend import StoreSide
from trainer.workload import BoundWorkload, build_workload, dataset_fingerprint

log = logging.getLogger("trainer")
REFUSALS = (CorruptGeneration, FingerprintMismatch, CrashLoop, UntrustedGeneration)
"""Found before training: the attempt holds the output but refuses to go on (65, 70)."""


@dataclass(frozen=True)
class Outcome:
    status: int
    reason: str | None
    """Why the attempt ended (None for a completed run)."""


@dataclass(frozen=True)
class Claim:
    """What rank 0 found once it held the output, handed to every rank."""

    run: RunDirectory
    attempt_id: str
    generation: Verification | None
    """The verified generation to restore (None: a fresh start)."""
    verify_s: float
    manifest_sha256: str | None = None
    """Of the generation to restore: names exactly which sealed content is restored."""
    download: Transfer = Transfer(0, 0.0)
    """What restoring from a store downloaded (nothing when the local tier had it)."""


class TrainingRun:
    def __init__(self, config: RunConfig, ranks: Ranks, events: TrainingEvents):
        self.config = config
        self.ranks = ranks
        self.events = events
        self.workload: BoundWorkload = build_workload(config.workload)
        self.attempt_id = new_attempt_id()
        self.started = time.monotonic()
        self.claimed: RunDirectory | None = None
        """The output once rank 0 holds its lock."""
        self.considered: str | None = None
        """The generation chosen for restore, before it verified."""
        self.recorder: AttemptRecorder | None = None
        self.signing = load_signing(config.signing)
        """With a key: what this attempt publishes is signed, what it restores must be."""
        """This attempt's record once started (it then records its own end)."""
        self.progress = Progress.for_stdout(config.progress, ranks.is_primary)
        """Progress lines, or a status line on a terminal: rank 0 only."""
        self.store = StoreSide(config) if config.store is not None else None
        """When the run directory lives in an object store (`--output s3://…`)."""

    # ----------------------------------------------------------------- top level
    def run(self) -> Outcome:
        # Signals are caught for the whole attempt (claim, restore, training, final drain), so
        # a preemption at any moment ends as exit 75 with a `preempted` record.
        with contextlib.ExitStack() as held, PreemptionGuard(self.config.preempt_grace_secs) as preemption:
            held.callback(self.progress.close)  # clears a terminal's status line on every way out
            try:
                # Rank 0's output wins: under --tracked only rank 0 opens the Polyaxon run and
                # knows its outputs path (other ranks start with output None).
                claim = self.ranks.decide_on_primary(lambda: self.claim(held), "claiming the output")
                if self.config.store is None:  # with a store every rank has its own local tier
                    self.ranks.require_on_every_rank(unshared_output(claim.run.root, self.ranks.is_primary),
                                                     "checking that every rank sees the output")
                self.attempt_id = claim.attempt_id
                return self.attempt(claim, preemption)
            except REFUSALS as refusal:
                self.record_refusal(refusal)
                raise
            finally:
                self.push_record()

    def claim(self, held: contextlib.ExitStack) -> Claim:
        """Rank 0 only: take the output lock, clean up, choose and verify what to restore."""
        config = self.config
        run = RunDirectory(config.output)
        asked_to_resume = config.resume == "latest" or config.from_generation is not None
        run.prepare(must_exist=asked_to_resume and config.store is None)
        held.enter_context(OutputLock(run.root))
        self.claimed = run
        remote = self.store.claim(run, self.attempt_id, held) if self.store else None
        stores = (LocalSection(run.checkpoints, self.signing), LocalSection(run.exports, self.signing))
        for store in stores:
            for name in store.recover_interrupted_replacements():
                log.warning("restored %s/%s: a crash interrupted its replacement", store.root.name, name)
            for name in store.uncommitted() if remote is None else ():
                log.warning("%s has no manifest: an uncommitted copy (kept, never selected)", store.path(name))
        started = time.monotonic()
        if remote is not None:
            names, where = remote.generations.committed(), remote.generations.url("").rstrip("/")
        else:
            names, where = stores[0].names(), str(stores[0].root)
        self.considered = choose_candidate(names, config.resume, config.from_generation, where)
        if remote is not None:
            remote.reconcile()  # only once this attempt goes ahead: it deletes what is not committed
        generation, download = None, Transfer(0, 0.0)
        if self.considered and remote is not None:
            generation, download = remote.restorable(self.considered, names)
        elif self.considered:
            generation = verify_candidate(stores[0], self.considered)
        verify_s = time.monotonic() - started - download.seconds
        for store in stores:
            for name in store.remove_stale_temporaries():  # only once this attempt goes ahead
                log.info("removed stale temporary %s/%s", store.root.name, name)
        return Claim(run, self.attempt_id, generation, verify_s,
                     manifest_digest(generation.path) if generation else None, download)

    def push_record(self) -> None:
        """Rank 0 with a store: copy this attempt's record there."""
        if self.store is not None and self.claimed is not None:
            self.store.push_record(self.claimed.attempt_folder(self.attempt_id))

    def record_refusal(self, refusal: TrainerError) -> None:
        """Rank 0, holding the output, refused to train (65, 70) before its record started:
        leave one `refused` record, so every start an orchestrator made is accounted for."""
        if not self.ranks.is_primary or self.claimed is None or self.recorder is not None:
            return
        previous = previous_attempt(read_attempts(self.claimed.root))
        fields = {"restored": None, "considered_generation": self.considered,
                  "previous_attempt": previous["id"] if previous else None,
                  "polyaxon": self.events.run_identity(previous)}
        try:
            AttemptRecorder.refused_before_start(self.claimed, self.attempt_id, list(self.config.argv),
                                                 refusal.exit_code, str(refusal), fields, self.started)
        except OSError as error:  # the refusal itself is what the user must see
            log.warning("could not record the refused attempt: %s", error)

    # ----------------------------------------------------------------- one attempt
    def attempt(self, claim: Claim, preemption: PreemptionGuard) -> Outcome:
        """Check the environment, start the record, then build, restore and train."""
        config, ranks = self.config, self.ranks
        configure_determinism(config, ranks.rank)
        dataset = self.workload.build_dataset()
        ranks.decide_on_primary(lambda: require_even_split(len(dataset), config.workload.batch_size,
                                                            ranks.world_size), "checking the batch split")
        fingerprint = current_fingerprint(config.workload.training_relevant(), dataset_fingerprint(dataset),
                                          ranks.device, world_size=ranks.world_size,
                                          workload_sources=self.workload.source_files)
        generation = claim.generation
        drift = [] if generation is None else ranks.decide_on_primary(lambda: check_fingerprint(
            generation.name, generation.manifest.fingerprint, fingerprint, config.allow_drift),
            "checking the fingerprint")
        history = read_attempts(claim.run.root)
        restoring = generation.name if generation else None
        ranks.decide_on_primary(lambda: refuse_crash_loop(history, restoring, config.max_failed_attempts,
                                                          claim.run.attempts), "checking for a crash loop")
        mode = effective_mode(config.checkpoint_mode, ranks.device, ranks.world_size)
        recorder = self.start_record(claim, history, fingerprint, drift, mode)
        self.push_record()  # a `running` record in the store: a kill -9 of this machine still counts
        checkpointer = self.checkpointer(mode, claim)
        lineage = Lineage(fingerprint, tuple(drift), frozenset([generation.name]) if generation else frozenset())
        if claim.download.bytes:
            recorder.downloaded(claim.download.seconds, claim.download.bytes)
        saves = CadencedSaves(config, claim.run, checkpointer, lineage, ranks, recorder, self.events, self.attempt_id,
                              self.store.uploader(lineage.protected, claim.run.attempt_folder(self.attempt_id))
                              if self.store else None)
        preemption.last_words = lambda reason: recorder.ended(PREEMPTED, EXIT_INTERRUPTED, reason)
        try:
            self.events.attempt_started(recorder.record)
            return self.train(claim, KeyedSeeding(dataset, config.workload.seed), drift, saves, preemption)
        except (CorruptGeneration, FingerprintMismatch, UntrustedGeneration) as refusal:
            # Found while restoring, before the first step (a shape-changing drift, stored
            # data that disagrees with its rank): a refusal, like the ones found earlier.
            recorder.refused(refusal.exit_code, str(refusal), generation.name if generation else None)
            raise
        except BaseException as error:
            saves.close_after_failure()
            code = error.exit_code if isinstance(error, TrainerError) else 1
            recorder.ended(FAILED, code, str(error) if isinstance(error, TrainerError)
                           else f"{error.__class__.__name__}: {error}")
            raise

    def checkpointer(self, mode: str, claim: Claim):
        """Local publishing (with a store, followed by tiered uploads); or, for several
        processes with a store, saves straight to the store from every rank's own disk."""
        if self.store is not None and self.ranks.distributed:
            return self.store.checkpointer(self.attempt_id, self.ranks)
        return build_checkpointer(mode, LocalSection(claim.run.checkpoints, self.signing), self.attempt_id,
                                  self.ranks.device, self.ranks)

    def start_record(self, claim: Claim, history: list[dict], fingerprint: dict, drift: list[str],
                     mode: str) -> AttemptRecorder:
        config, ranks, generation = self.config, self.ranks, claim.generation
        previous = previous_attempt(history)
        step = generation.manifest.step if generation else None
        stored_world_size = generation.manifest.fingerprint.get("world_size") if generation else None
        self.recorder = AttemptRecorder.start(claim.run, self.attempt_id, list(config.argv), {
            "restored": None if generation is None else {
                "name": generation.name, "step": step, "manifest_sha256": claim.manifest_sha256},
            "explicit_generation": config.from_generation is not None, "set_aside": [],
            "previous_attempt": previous["id"] if previous else None,
            "steps_replayed": steps_replayed(previous, step) if generation else None,
            "allowed_drift": list(config.allow_drift), "drift": drift,
            "checkpoint_mode": mode, "device": str(ranks.device), "fingerprint": fingerprint, "store": config.store,
            "polyaxon": self.events.run_identity(previous),
            "world_size": ranks.world_size, **world_size_change(stored_world_size, ranks.world_size),
            "allow_unsigned": config.signing.allow_unsigned,
        }, persist=ranks.is_primary)
        return self.recorder

    def build(self) -> tuple[TrainingState, nn.Module]:
        """The live state, and the module to run forward/backward through: the model itself,
        DDP around it, or (under FSDP) the same module sharded in place, which is why the
        optimizer is built after wrapping."""
        config, workload, device = self.config, self.workload, self.ranks.device
        model = workload.build_model().to(device)
        trained = self.ranks.data_parallel(model, config.workload.data_parallel)
        optimizer = workload.build_optimizer(model)
        scheduler = workload.build_scheduler(optimizer)
        scaler = torch.amp.GradScaler(device.type, enabled=config.workload.amp and device.type == "cuda")
        state = TrainingState(model, optimizer, scheduler, scaler, rank=self.ranks.rank,
                              world_size=self.ranks.world_size, extras=workload.stateful())
        return state, trained

    def restore_state(self, claim: Claim, state: TrainingState, drift: list[str], saves: CadencedSaves) -> None:
        """The mirror of a save, then what continues across processes: an allowed config
        change, the cadence counters, and (going back) the abandoned later line."""
        generation = claim.generation
        if self.store is not None and not self.ranks.is_primary:
            generation = self.store.local_copy(generation)
        restored = restore(generation, state)
        if state.progress.global_step != restored.step:
            raise CorruptGeneration(f"generation {restored.name} holds step {state.progress.global_step}, but its "
                                    f"manifest says {restored.step}; restore another one with --from-generation")
        if any(change.startswith("config.") for change in drift):
            self.workload.adopt_config(state.optimizer, state.scheduler)  # an allowed --lr change takes effect
            if not self.workload.adopts_config:
                log.warning("config drift accepted, but the workload has no adopt_config: the restored optimizer "
                            "and scheduler keep the values they were saved with (e.g. the learning rate)")
        saves.load_cadence(restored.manifest.cadence)
        self.recorder.restored(restored, claim.verify_s)
        self.recorder.set_aside(self.ranks.decide_on_primary(lambda: self.abandon_later_line(claim.run, restored.step),
                                                             "setting aside the abandoned line"))
        progress = state.progress
        log.info("restored %s (step=%d epoch=%d position=%d) in %.3fs", restored.name, progress.global_step,
                 progress.epoch, progress.position, self.recorder.restore_s)

    def abandon_later_line(self, run: RunDirectory, restored_step: int) -> list[str]:
        """Rank 0, once the restore succeeded: going back with --from-generation abandons
        every later generation and export (see `set_aside_later_line`)."""
        if self.config.from_generation is None:
            return []
        abandoned = set_aside_later_line(LocalSection(run.checkpoints), LocalSection(run.exports),
                                         restored_step)
        if self.store is not None:
            abandoned += self.store.set_aside_later_than(restored_step)
        if abandoned:
            log.warning("went back to %s: set aside %d later generations and exports (%s), kept as "
                        "superseded copies", self.config.from_generation, len(abandoned), ", ".join(abandoned))
        return abandoned

    # ----------------------------------------------------------------- training
    def train(self, claim: Claim, dataset: KeyedSeeding, drift: list[str], saves: CadencedSaves,
              preemption: PreemptionGuard) -> Outcome:
        config, ranks = self.config, self.ranks
        state, trained = self.build()
        steps = OptimizerSteps(self.workload, state, trained, ranks.device, config.workload.amp)
        if claim.generation is not None:
            self.restore_state(claim, state, drift, saves)
        self.recorder.reached(state.progress.global_step, first=True)
        batches_per_epoch = len(EpochBatchOrder(len(dataset), config.workload.batch_size, config.workload.seed, 0, 0))
        accumulate = config.workload.grad_accum
        total_steps = config.workload.epochs * -(-batches_per_epoch // accumulate)
        self.progress.begin(total_steps)
        self.warn_if_interrupt_cannot_fire(state.progress.global_step, total_steps)
        if preemption.requested and not ranks.distributed:  # signalled while claiming or restoring
            signal_name = preemption.signal_name
            return self.end(PREEMPTED, f"{signal_name} before training resumed; nothing to save", saves, state,
                            f"preempted by {signal_name} before the first step (exit 75)")
        while state.progress.global_step < total_steps:
            # Micro-batches accumulate into windows of --grad-accum; an epoch's last window may
            # be shorter. Everything below the `continue` runs once per optimizer step, so
            # saves and stops never see partial gradients.
            window, seen, loss = 0, 0, None
            for batch in epoch_loader(dataset, self.batch_order(len(dataset), state), config.workload.num_workers):
                if seen == 0:
                    saves.wait_for_staging()  # the staged copy must be complete before parameters change
                    window = steps.open_window(min(accumulate, batches_per_epoch - state.progress.position))
                part = steps.micro_batch(batch, window)
                loss = part if loss is None else loss + part
                seen += 1
                if seen < window:
                    continue
                lr = steps.step()
                epoch_completed = state.progress.advance(window, batches_per_epoch)
                step = state.progress.global_step
                agreed = saves.agree(StepPoint(step, state.progress.epoch, epoch_completed), loss,
                                     preemption.requested)
                seen, loss = 0, None
                last = step in (config.interrupt_at_step, total_steps) or agreed.preempt
                self.step_completed(state, step, agreed.loss, float(lr), last)
                if step == config.interrupt_at_step:
                    return self.end(INTERRUPTED, f"--interrupt-at-step {step}: stopped without saving", saves, state,
                                    f"interrupted after step {step} without saving (exit 75)")
                saves.after_step(state, state.model, self.workload, agreed, final=step == total_steps)
                if agreed.preempt:
                    signal_name = preemption.signal_name or "a signal to another rank"
                    return self.end(PREEMPTED, f"{signal_name} after step {step}; generation saved", saves, state,
                                    f"preempted by {signal_name}: saved step {step} (exit 75)")
        return self.end(COMPLETED, None, saves, state)

    def batch_order(self, samples: int, state: TrainingState) -> EpochBatchOrder:
        """This rank's batches for the rest of the current epoch."""
        config, progress = self.config.workload, state.progress
        return EpochBatchOrder(samples, config.batch_size, config.seed, progress.epoch, progress.position,
                               self.ranks.rank, self.ranks.world_size)

    def step_completed(self, state: TrainingState, step: int, loss: float, lr: float, last: bool) -> None:
        """`last`: this attempt's final step (always shown)."""
        state.history.loss.append(loss)
        state.history.lr.append(lr)
        self.recorder.mark_step(step)
        self.progress.step(step, state.progress.epoch, loss, lr, self.recorder.newest_generation, last=last)
        self.events.step_completed(step, {"loss": loss, "lr": lr})

    def warn_if_interrupt_cannot_fire(self, first_step: int, total_steps: int) -> None:
        interrupt = self.config.interrupt_at_step
        if interrupt is not None and not first_step < interrupt <= total_steps:
            log.warning("--interrupt-at-step %d is outside steps %d..%d of this attempt; it will not fire",
                        interrupt, first_step + 1, total_steps)

    def end(self, status: str, reason: str | None, saves: CadencedSaves, state: TrainingState,
            said: str | None = None) -> Outcome:
        """The one way out of training: drain the save in flight, record, say so."""
        step = state.progress.global_step
        saves.finalize(step)  # an earlier save may still be in flight, and uploads
        exit_code, summary = EXIT_INTERRUPTED, None
        if status == COMPLETED:
            # Saving straight to a store leaves no local copies: this attempt's record knows.
            newest = max(saves.generations.names()[-1:] + [self.recorder.newest_generation or ""])
            exit_code = EXIT_OK
            summary = {"final_step": step, "epochs": state.progress.epoch,
                       "final_generation": newest or None,
                       "final_loss": state.history.loss[-1] if state.history.loss else None,
                       "history": {"loss": state.history.loss, "lr": state.history.lr}}
            said = f"completed {step} steps; newest generation {summary['final_generation']}"
        if self.store is not None and self.ranks.is_primary:  # what survives this machine: log, record, 75 line
            durable = f"newest durable in {self.store.url}: {self.recorder.newest_durable or self.considered or 'none'}"
            said += f"; {durable}"
            reason = f"{reason}; {durable}" if reason else reason
        self.recorder.reached(step)
        self.recorder.ended(status, exit_code, reason, summary)
        log.info("%s", said)
        return Outcome(exit_code, reason)


def run_training(config: RunConfig, launch: LaunchEnvironment = LaunchEnvironment(),
                 events: TrainingEvents = TrainingEvents()) -> Outcome:
    """Run on every rank; all ranks return the same status."""
    with process_group(launch, resolve_device(config.device)) as ranks:
        outcome = TrainingRun(config, ranks, events).run()
        ignore_late_stop_requests()
        ranks.finish()
        return outcome
