"""The training run, top to bottom: claim the run directory → choose what to restore → build
the state → restore it → train → save and export on cadence → record the attempt → end.

Under torchrun every rank runs this same flow. Rank 0 alone claims the run directory, chooses
and verifies the generation, checks the fingerprint, publishes, exports and records the
attempt; `self.ranks` hands its results (or its error) to the other ranks. Where the run
directory lives is the backend's business (`RunStorage`): nothing here asks which kind it is.

Every blocking point of checkpointing is visible in `train()`: `saves.after_step()` after a
step the cadence picked, `saves.wait_for_staging()` right before the next optimizer step,
`saves.finalize()` before the end.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

from trainer.config import RunConfig
from trainer.errors import (EXIT_INTERRUPTED, EXIT_OK, CorruptGeneration, CrashLoop, FingerprintMismatch,
                            PeerFailure, UntrustedGeneration)
from trainer.parallel.launch import LaunchEnvironment
from trainer.parallel.ranks import Ranks, process_group, unshared_output
from trainer.run.attempts import new_attempt_id
from trainer.run.records import COMPLETED, INTERRUPTED, PREEMPTED
from trainer.run.claim import Claim, Claimant, claim_on_every_rank
from trainer.run.events import TrainingEvents
from trainer.run.failures import attributed
from trainer.run.preemption import PreemptionGuard, ignore_late_stop_requests
from trainer.run.progress import Progress
from trainer.run.recording import check_attempt, record_refusal, start_record
from trainer.run.restoring import Restorer
from trainer.run.runtime import configure_determinism, resolve_device
from trainer.run.saving import CadencedSaves, Lineage, Witnesses
from trainer.run.streaming import DataSource, data_source
from trainer.run.training import Training, build_training, train_steps
from trainer.storage.opening import open_storage
from trainer.workload import BoundWorkload, build_workload

log = logging.getLogger("trainer")
REFUSALS = (CorruptGeneration, FingerprintMismatch, CrashLoop, UntrustedGeneration)
"""Found before training: the attempt holds the run directory but refuses to go on (65, 70)."""


@dataclass(frozen=True)
class Outcome:
    status: int
    reason: str | None
    """Why the attempt ended (None for a completed run)."""


class TrainingRun:
    def __init__(self, config: RunConfig, ranks: Ranks, events: TrainingEvents):
        self.config, self.ranks, self.events = config, ranks, events
        self.workload: BoundWorkload = build_workload(config.workload)
        self.attempt_id, self.started = new_attempt_id(), time.monotonic()
        self.storage = open_storage(config, ranks.launch)
        self.claimant = Claimant(config, self.storage, one_pass=ranks.world_size == 1)
        self.recorder = None
        """This attempt's record once started (it then records its own end)."""
        self.progress = Progress.for_stdout(config.progress, ranks.is_primary)
        """Progress lines, or a status line on a terminal: rank 0 only."""

    def run(self) -> Outcome:
        # Signals are caught for the whole attempt (claim, restore, training, final drain), so
        # a preemption at any moment ends as exit 75 with a `preempted` record.
        with contextlib.ExitStack() as held, PreemptionGuard(self.config.preempt_grace_s) as preemption:
            held.callback(self.progress.close)  # clears a terminal's status line on every way out
            try:
                # Rank 0's run directory wins: under --tracked only rank 0 knows the outputs path.
                claim = claim_on_every_rank(self.claimant, self.ranks, self.attempt_id, held)
                if not self.ranks.is_primary:
                    self.storage.join(claim.run)
                if self.storage.shares_one_disk:
                    self.ranks.require_on_every_rank(unshared_output(claim.run.root, self.ranks.is_primary),
                                                     "checking that every rank sees the run directory")
                self.attempt_id = claim.attempt_id
                return self.attempt(claim, preemption)
            except REFUSALS as refusal:
                if self.ranks.is_primary and self.claimant.held is not None and self.recorder is None:
                    record_refusal(self.claimant, self.attempt_id, refusal, self.events, self.started)
                raise
            finally:
                if self.claimant.held is not None:
                    self.storage.records.push(self.claimant.held.attempt_folder(self.attempt_id))

    def attempt(self, claim: Claim, preemption: PreemptionGuard) -> Outcome:
        """Check the environment, start the record, then build, restore and train."""
        config, ranks, generation = self.config, self.ranks, claim.generation
        configure_determinism(config, ranks.rank)
        config, dataset = data_source(self.workload.build_dataset(), config, self.workload.spec)
        self.config = config  # a DataLoader's batch size and workers, adopted (trainer/workload/adapters.py)
        checked = check_attempt(config, self.workload, claim, dataset, ranks)
        recorder = self.recorder = start_record(config, claim, checked, ranks, self.events)
        self.storage.records.push(claim.run.attempt_folder(self.attempt_id))  # a kill -9 of this machine still counts
        lineage = Lineage(self.attempt_id, checked.fingerprint, checked.drift,
                          frozenset([generation.name]) if generation else frozenset(), checked.shape, claim.history)
        if claim.download.bytes:
            recorder.downloaded(claim.download.seconds, claim.download.bytes)
        saves = CadencedSaves(config, self.storage, lineage, ranks, Witnesses(recorder, self.events), checked.mode)
        preemption.last_words = lambda reason: recorder.ended(PREEMPTED, EXIT_INTERRUPTED, reason)
        try:
            self.events.attempt_started(recorder.record)
            return self.train(claim, dataset, checked.drift, saves, preemption)
        except (CorruptGeneration, FingerprintMismatch, UntrustedGeneration) as refusal:
            # Found while restoring, before the first step (a shape-changing drift, stored
            # data that disagrees with its rank): a refusal, like the ones found earlier.
            recorder.refused(refusal.exit_code, str(refusal), generation.name if generation else None)
            raise
        except BaseException as error:
            preemption.decided()  # a stop signal from here on cannot make this failure a 75
            error = self.ranks.as_peer_failure(error)  # a lost peer is never the workload's error
            saves.close_after_failure(peers_lost=isinstance(error, PeerFailure))
            attributed(error).record_and_raise(recorder)  # the workload's own exception: one line naming where

    def train(self, claim: Claim, dataset: DataSource, drift: tuple[str, ...], saves: CadencedSaves,
              preemption: PreemptionGuard) -> Outcome:
        training: Training = build_training(self.config, self.workload, self.ranks, dataset)
        if claim.generation is not None:
            Restorer(self.config, self.storage, self.ranks, self.workload).restore(claim, training.state, drift,
                                                                                  saves, self.recorder)
        state = training.state
        self.recorder.reached(state.progress.global_step, first=True)
        self.progress.begin(training.total_steps)
        self.warn_if_interrupt_cannot_fire(state.progress.global_step, training.total_steps)
        if preemption.requested and not self.ranks.distributed:  # signalled while claiming or restoring
            signal_name = preemption.signal_name
            return self.end(PREEMPTED, f"{signal_name} before training resumed; nothing to save", saves, state,
                            f"preempted by {signal_name} before the first step (exit 75)")
        with contextlib.closing(train_steps(training, dataset, saves, preemption)) as steps:
            for done in steps:
                outcome = self.after_step(done, training, saves, preemption)
                if outcome is not None:
                    return outcome
        return self.end(COMPLETED, None, saves, state)

    def after_step(self, done, training: Training, saves: CadencedSaves, preemption: PreemptionGuard) -> Outcome | None:
        """Record the step, then save on cadence; an Outcome when the attempt ends here."""
        step, agreed, state = done.step, done.agreed, training.state
        last = step in (self.config.interrupt_at_step, training.total_steps) or agreed.preempt
        self.step_completed(state, done, last)
        if step == self.config.interrupt_at_step:
            return self.end(INTERRUPTED, f"--interrupt-at-step {step}: stopped without saving", saves, state,
                            f"interrupted after step {step} without saving (exit 75)")
        saves.after_step(state, state.model, self.workload, agreed, final=step == training.total_steps)
        if agreed.preempt:
            signal_name = preemption.signal_name or "a signal to another rank"
            return self.end(PREEMPTED, f"{signal_name} after step {step}; generation saved", saves, state,
                            f"preempted by {signal_name}: saved step {step} (exit 75)")
        return None

    def step_completed(self, state, done, last: bool) -> None:
        """`last`: this attempt's final step (always shown)."""
        state.history.loss.append(done.agreed.loss)
        state.history.lr.append(done.lr)
        self.recorder.mark_step(done.step, done.digest)
        self.progress.step(done.step, state.progress.epoch, done.agreed.loss, done.lr, self.recorder.newest_generation,
                           last=last)
        self.events.step_completed(done.step, {"loss": done.agreed.loss, "lr": done.lr})

    def warn_if_interrupt_cannot_fire(self, first_step: int, total_steps: int) -> None:
        if (interrupt := self.config.interrupt_at_step) is not None and not first_step < interrupt <= total_steps:
            log.warning("--interrupt-at-step %d is outside steps %d..%d of this attempt; it will not fire",
                        interrupt, first_step + 1, total_steps)

    def end(self, status: str, reason: str | None, saves: CadencedSaves, state, said: str | None = None) -> Outcome:
        """The one way out of training: drain the save in flight, record, say so."""
        step = state.progress.global_step
        self.ranks.finishing()  # draining was never measured: the peers wait as at the start
        saves.finalize(step)  # an earlier save may still be in flight, and uploads
        exit_code, summary = EXIT_INTERRUPTED, None
        if status == COMPLETED:
            # Saving straight to an object store leaves no local copies: this attempt's record knows.
            newest = max(saves.generations.names()[-1:] + [self.recorder.newest_generation or ""])
            exit_code = EXIT_OK
            summary = {"final_step": step, "epochs": state.progress.epoch,
                       "final_generation": newest or None,
                       "final_loss": state.history.loss[-1] if state.history.loss else None,
                       "history": {"loss": state.history.loss, "lr": state.history.lr}}
            said = f"completed {step} steps; newest generation {summary['final_generation']}"
        # What survives this machine: in the log, the record and the 75 line.
        if durable := self.storage.records.note(self.recorder.newest_durable, self.claimant.considered):
            said += f"; {durable}"
            reason = f"{reason}; {durable}" if reason else reason
        self.recorder.reached(step)
        self.recorder.ended(status, exit_code, reason, summary)
        log.info("%s", said)
        return Outcome(exit_code, reason)


def run_training(config: RunConfig, launch: LaunchEnvironment = LaunchEnvironment(),
                 events: TrainingEvents = TrainingEvents()) -> Outcome:
    """Run on every rank; all ranks return the same status."""
    with process_group(launch, resolve_device(config.device), config.background_wait, config.peer_wait) as ranks:
        outcome = TrainingRun(config, ranks, events).run()
        ignore_late_stop_requests()
        ranks.finish()
        return outcome
