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
from dataclasses import replace

from trainer.config import RunConfig
from trainer.parallel.launch import LaunchEnvironment
from trainer.parallel.ranks import Ranks, process_group
from trainer.run.records import COMPLETED, INTERRUPTED, PREEMPTED
from trainer.run.claim import Claim
from trainer.run.events import TrainingEvents
from trainer.run.preemption import PreemptionGuard, ignore_late_stop_requests
from trainer.run.progress import Progress
from trainer.run.restoring import Restorer
from trainer.run.runtime import configure_determinism, resolve_device
from trainer.run.readback import StepRead, StepReadback, next_point, record_step
from trainer.run.saving import CadencedSaves
from trainer.run.session import AttemptSession, Outcome
from trainer.data.source import DataSource, data_source
from trainer.run.training import Training, build_training, train_steps
from trainer.workload import BoundWorkload, build_workload

log = logging.getLogger("trainer")


class TrainingRun:
    def __init__(self, config: RunConfig, ranks: Ranks, events: TrainingEvents):
        self.config, self.ranks, self.events = config, ranks, events
        self.workload: BoundWorkload = build_workload(config.workload, config.store_config)
        self.session = AttemptSession(config, ranks, events)
        """The claim, the record and the end, shared with a user's own loop (trainer/recovery/)."""
        self.progress = Progress.for_stdout(config.progress, ranks.is_primary)
        """Progress lines, or a status line on a terminal: rank 0 only."""

    @property
    def recorder(self):
        return self.session.recorder

    def run(self) -> Outcome:
        # Signals are caught for the whole attempt (claim, restore, training, final drain), so
        # a preemption at any moment ends as exit 75 with a `preempted` record.
        with contextlib.ExitStack() as held, PreemptionGuard(self.config.preempt_grace_s) as preemption, \
                self.session.refusals_recorded():
            held.callback(self.progress.close)  # clears a terminal's status line on every way out
            return self.attempt(self.session.claim(held), preemption)

    def attempt(self, claim: Claim, preemption: PreemptionGuard) -> Outcome:
        """Check the environment, start the record, then build, restore and train."""
        configure_determinism(self.config, self.ranks.rank)
        config, dataset = data_source(self.workload.build_dataset(), self.config, self.workload.spec)
        # A DataLoader's batch size and workers, adopted (trainer/workload/adapters.py), and a
        # resumed generation's gradient reduction, kept.
        config = self.config = replace(config, workload=claim.kept(config.workload, self.ranks))
        saves, checked = self.session.begin(claim, self.workload, dataset, preemption, config)
        try:
            self.events.attempt_started(self.recorder.record)
            return self.train(claim, dataset, checked.drift, saves, preemption)
        except BaseException as error:
            self.session.fail(error, claim, saves, preemption)

    def train(self, claim: Claim, dataset: DataSource, drift: tuple[str, ...], saves: CadencedSaves,
              preemption: PreemptionGuard) -> Outcome:
        training: Training = build_training(self.config, self.workload, self.ranks, dataset)
        if claim.generation is not None:
            Restorer(self.config, self.session.storage, self.session.memory, self.ranks, self.workload).restore(
                claim, training.state, drift, saves, self.recorder)
        state = training.state
        self.recorder.reached(state.progress.global_step, first=True)
        self.progress.begin(training.total_steps)
        self.warn_if_interrupt_cannot_fire(state.progress.global_step, training.total_steps)
        if preemption.requested and not self.ranks.distributed:  # signalled while claiming or restoring
            signal_name = preemption.signal_name
            return self.end(PREEMPTED, f"{signal_name} before training resumed; nothing to save", saves, state,
                            f"preempted by {signal_name} before the first step (exit 75)")
        self.readback = StepReadback(self.ranks, saves.votes, training.parameters, lambda: preemption.requested,
                                     lambda read: self.step_completed(state, read), lambda: next_point(
                                         state.progress, self.config.workload.grad_accum, training.shape.batches))
        with contextlib.closing(train_steps(training, dataset, saves, self.readback)) as steps:
            for done in steps:
                outcome = self.after_step(done, training, saves, preemption)
                if outcome is not None:
                    return outcome
        return self.end(COMPLETED, None, saves, state)

    stopping: str | None = None
    """Set once a stop signal's generation is saved: the reason the attempt then ends with."""

    def after_step(self, done, training: Training, saves: CadencedSaves, preemption: PreemptionGuard) -> Outcome | None:
        """Save on cadence; an Outcome when the attempt ends here. The step before was recorded
        as this one was queued; this one is read first where the state is saved or the attempt
        ends (`StepReadback.flush`). After a stop signal's save one more step runs, for the
        witness only: its digest is recorded and it is not saved, so the next attempt replays it
        (trainer/run/witness.py)."""
        step, agreed, state = done.step, done.agreed, training.state
        if self.stopping is not None:
            self.readback.flush(last=True)  # recorded as the witness's step (`step_completed`), never saved
            saved = step - 1
            return self.end(PREEMPTED, self.stopping, saves, state, f"preempted by {preemption.stop_cause}: saved step "
                            f"{saved} (exit 75); step {step} computed for the witness, not saved")
        last = step in (self.config.interrupt_at_step, training.total_steps) or agreed.preempt
        self.readback.acting(agreed, last)
        if step == self.config.interrupt_at_step:
            return self.end(INTERRUPTED, f"--interrupt-at-step {step}: stopped without saving", saves, state,
                            f"interrupted after step {step} without saving (exit 75)")
        saves.after_step(state, state.model, self.workload, agreed, final=step == training.total_steps)
        if agreed.preempt:
            signal_name = preemption.stop_cause
            self.stopping = f"{signal_name} after step {step}; generation saved"
            if step < training.total_steps:
                return None  # the step after it, for the witness (above)
            return self.end(PREEMPTED, self.stopping, saves, state, f"preempted by {signal_name}: saved step {step} "
                            f"(exit 75)")
        return None

    def step_completed(self, state, read: StepRead) -> None:
        """A step's values, read a step later (`read.last`: this attempt's final step, always shown);
        the step after a stop signal's save goes to the witness alone."""
        record_step(state, self.recorder, self.events, read, witness_only=self.stopping is not None)
        self.progress.step(read.step, read.epoch, read.loss, read.lr, self.recorder.newest_generation, last=read.last)

    def warn_if_interrupt_cannot_fire(self, first_step: int, total_steps: int) -> None:
        if (interrupt := self.config.interrupt_at_step) is not None and not first_step < interrupt <= total_steps:
            log.warning("--interrupt-at-step %d is outside steps %d..%d of this attempt; it will not fire",
                        interrupt, first_step + 1, total_steps)

    def end(self, status: str, reason: str | None, saves: CadencedSaves, state, said: str | None = None) -> Outcome:
        return self.session.end(status, reason, saves, state, said)


def run_training(config: RunConfig, launch: LaunchEnvironment = LaunchEnvironment(),
                 events: TrainingEvents = TrainingEvents()) -> Outcome:
    """Run on every rank; all ranks return the same status."""
    with process_group(launch, resolve_device(config.device), config.background_wait, config.peer_wait,
                       config.data_parallel_backend) as ranks:
        outcome = TrainingRun(config, ranks, events).run()
        ignore_late_stop_requests()
        ranks.finish()
        return outcome
