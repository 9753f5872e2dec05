"""Both loops' per-step path, which never waits on the device.

After step N is queued, the loop reads what was decided for it (the agreement started after
step N-1: rank 0's cadence votes for N and every rank's stop flag) and records step N-1 (its
loss, its learning rate, the witness's digest: the history, the progress line, the attempt's
step log, the metric event), whose values were copied to the host meanwhile. Step N's own
values stay on the device until the next step is queued; its loss rides in the agreement
started after it (and after its saves: a time trigger sees the save just made). So nothing
on a step's path reads a value the step produced, and under torchrun the one collective per
step is never waited for where it was started (trainer/parallel/hostcopy.py says how the
copies avoid waiting for the device).

Where the state is saved or the attempt ends (a save, the final step, a stop, an interrupt),
`flush` reads the queued step first, so a generation saved after step N holds the history
through N and the witness's log holds every step; that read may wait, off the per-step path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from trainer.parallel.hostcopy import Landed
from trainer.parallel.ranks import PendingAgreement, Ranks, StepAgreement
from trainer.run.cadence import StepPoint
from trainer.run.checksum import parameter_sums, placed_checksum
from trainer.run.attempts import AttemptRecorder
from trainer.run.events import TrainingEvents
from trainer.run.state import Progress, TrainingState
from trainer.run.witness import step_digest


@dataclass
class Queued:
    """A step whose values are not read yet."""

    step: int
    epoch: int
    lr: float
    loss: torch.Tensor
    """On the device until the next agreement carries it (or a flush reads it)."""
    sums: Landed | None
    """The witness's word sums of the step's share of the parameters, on their way to the host."""
    carried: bool = False
    """The agreement in flight carries this loss."""


@dataclass(frozen=True)
class StepRead:
    """A step's values, read: what the loops record (`StepReadback`'s `record`)."""

    step: int
    epoch: int
    loss: float
    lr: float
    digest: str
    last: bool
    """The attempt stops after this step (the final step, an interrupt, a stop): always shown."""


def next_point(progress: Progress, window: int, batches_per_epoch: int) -> StepPoint:
    """The step point the next optimizer step will reach: `window` micro-batches more (an
    epoch's last window may be shorter), as `Progress.advance` will count them."""
    ahead = copy.copy(progress)
    completed = ahead.advance(min(window, batches_per_epoch - ahead.position), batches_per_epoch)
    return StepPoint(ahead.global_step, ahead.epoch, completed)


class StepReadback:
    """The agreements one step ahead and the values one step behind, for one attempt.

    `votes(point)`: rank 0's cadence votes for a step point (`CadencedSaves.votes`);
    `stop_requested()`: whether this rank was signalled; `record(StepRead)`: the loop's own
    bookkeeping of a step, called once per step, in order; `ahead()`: the point the next
    step will reach (`next_point`)."""

    def __init__(self, ranks: Ranks, votes: Callable[[StepPoint], tuple[bool, bool, bool]], parameters: list,
                 stop_requested: Callable[[], bool], record: Callable[[StepRead], None],
                 ahead: Callable[[], StepPoint]):
        self.ranks, self.votes, self.parameters = ranks, votes, parameters
        self.stop_requested, self.record, self.ahead = stop_requested, record, ahead
        self.copier = ranks.copier  # a side stream per device: the parameters may live elsewhere
        self.pending: PendingAgreement | None = None
        """The agreement on what follows the next step (or the step queued), started."""
        self.queued: Queued | None = None

    @property
    def voted(self) -> bool:
        return self.pending is not None

    def vote(self, point: StepPoint | None = None) -> None:
        """After a step and its saves (and right after the restore): start the agreement on
        what follows the next step (at `point`: `ahead()`), carrying the queued step's loss;
        nothing if it is started already."""
        if self.voted:
            return
        queued = self.queued if self.queued is not None and not self.queued.carried else None
        point = point or self.ahead()
        self.pending = self.ranks.start_agreement(queued.loss if queued else None, lambda: self.votes(point),
                                                  self.stop_requested)
        if queued is not None:
            queued.carried = True

    def stepped(self, point: StepPoint, loss, lr: float) -> StepAgreement:
        """Step `point.step` is queued: the step before recorded, then what was agreed for this
        one (with one process its decisions are taken now, after the record: a signal that came
        before the step before was recorded stops after this step). Its own loss and checksum
        are copied to the host, to be read after the next step."""
        self.vote(point)  # started already, unless a caller skipped the save after a due one (then: waited here)
        pending, self.pending = self.pending, None
        if self.queued is not None:
            self.read(self.queued, pending.loss(), last=False)
        agreed = pending.decisions()
        sums = parameter_sums(self.parameters, point.step)
        self.queued = Queued(point.step, point.epoch, float(lr), torch.as_tensor(loss).detach(),
                             self.copier.copy(sums) if sums is not None else None)
        return agreed

    def flush(self, last: bool = False) -> None:
        """Read the queued step now (a save, a stop, the end: every rank at the same point).
        Its loss comes with the agreement in flight if that carries it (its decisions are
        still taken when the next step asks), else from a collective of its own."""
        queued, self.queued = self.queued, None
        if queued is None:
            return
        loss = self.pending.loss() if queued.carried else self.ranks.mean_loss(queued.loss)
        self.read(queued, loss, last)

    def acting(self, agreed: StepAgreement, last: bool = False) -> None:
        """Before what `agreed` calls for after the step (a save, a stop) or the attempt's
        `last` step: the step read, so the state saved holds its history."""
        if last or agreed.acts:
            self.flush(last or agreed.preempt)

    def finish(self) -> None:
        """The attempt ends: every value read, and the agreement in flight (every rank has one
        at the same point) waited for."""
        self.flush(last=True)
        if self.pending is not None:
            self.pending.loss()
            self.pending = None

    def read(self, queued: Queued, loss: float, last: bool) -> None:
        checksum = placed_checksum(queued.sums.values() if queued.sums is not None else [], self.parameters,
                                   queued.step)
        self.record(StepRead(queued.step, queued.epoch, loss, queued.lr, step_digest(loss, checksum), last))


def record_step(state: TrainingState, recorder: AttemptRecorder, events: TrainingEvents, read: StepRead,
                witness_only: bool = False) -> None:
    """What both loops record of every step, once read: the history the state saves, the
    witness's step log (`mark_step`) and the metric event. `witness_only`: the step after a stop
    signal's save, computed for the next attempt's replay and never saved, is the record's
    `witness_step` alone (`AttemptRecorder.witnessed`)."""
    if witness_only:
        recorder.witnessed(read.step, read.digest)
        return
    state.history.loss.append(read.loss)
    state.history.lr.append(read.lr)
    recorder.mark_step(read.step, read.digest)
    events.step_completed(read.step, {"loss": read.loss, "lr": read.lr})
