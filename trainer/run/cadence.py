"""When to save: small, pure policy objects, one per trigger, combined with `AnyOf`.

A policy sees a `StepPoint` after each optimizer step and answers `due()`. Step and epoch
triggers are pure functions of the step, so they continue unchanged after a resume. The
seconds trigger uses a monotonic clock; its only state ("seconds since the last save") is
carried across processes in the manifest, never in the training state, so a time trigger
decides *when* to save but never changes *what* is trained.

`AutoSeconds` (`--recover-every-secs auto`) is a seconds trigger whose interval is re-derived
after every save from the blocked seconds that save cost and the failure rate of the run's
history (trainer/run/interval.py), so it adapts like CheckFreq; it is still only *when*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from trainer.config import AutoCadenceConfig, CadenceConfig, MemoryTierConfig
from trainer.run.interval import FailureRate, best_interval, clamp
from trainer.run.records import AttemptRecord, attempts_that_trained, failure_rate, lifetime


@dataclass(frozen=True)
class StepPoint:
    step: int
    """Optimizer steps completed."""
    epoch: int
    """Epochs completed."""
    epoch_completed: bool
    """This step finished an epoch."""


class Policy(Protocol):
    def due(self, point: StepPoint) -> bool: ...
    def saved(self) -> None: ...
    def state(self) -> dict: ...
    def load_state(self, state: dict) -> None: ...


class StatelessTrigger:
    """A trigger that is a pure function of the step point: nothing to remember."""

    def saved(self) -> None:
        pass

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


@dataclass
class EveryEpochs(StatelessTrigger):
    epochs: int

    def due(self, point: StepPoint) -> bool:
        return point.epoch_completed and point.epoch % self.epochs == 0


@dataclass
class EverySteps(StatelessTrigger):
    steps: int

    def due(self, point: StepPoint) -> bool:
        return point.step % self.steps == 0


class SinceLastSave:
    """What both seconds triggers share: the time of the last save on an injected clock,
    carried across processes as "seconds since the last save". Subclasses say `interval_s`."""

    clock: Callable[[], float]
    last: float

    @property
    def interval_s(self) -> float:
        raise NotImplementedError

    def due(self, point: StepPoint) -> bool:
        return self.clock() - self.last >= self.interval_s

    def saved(self) -> None:
        self.last = self.clock()

    def state(self) -> dict:
        return {"secs_since_save": round(self.clock() - self.last, 6)}

    def load_state(self, state: dict) -> None:
        self.last = self.clock() - float(state.get("secs_since_save", 0.0))


@dataclass
class EverySeconds(SinceLastSave):
    seconds: float
    clock: Callable[[], float] = time.monotonic
    last: float = field(default=None)

    def __post_init__(self) -> None:
        if self.last is None:
            self.last = self.clock()

    @property
    def interval_s(self) -> float:
        return self.seconds


@dataclass(frozen=True)
class AutoPrior:
    """What earlier attempts measured, for the auto interval before this attempt saves."""

    rate: FailureRate = FailureRate(0, 0.0)
    cost_s: float | None = None
    """Mean blocked seconds per recovery save of the earlier attempts (None: none saved)."""


def auto_prior(records: Sequence[AttemptRecord], own_id: str) -> AutoPrior:
    """What the earlier attempts say for `--recover-every-secs auto`: how many failed over how
    many seconds (the report's M, trainer/run/records.py), and what a recovery save blocked on
    average. `own_id`'s record (this attempt, `running`) is left out; every other `running`
    record is a killed attempt."""
    earlier = earlier_attempts(records, own_id)
    blocked = [entry.blocked_s for record in earlier for entry in record.generations if entry.blocked_s is not None]
    return AutoPrior(failure_rate(map(lifetime, earlier)), sum(blocked) / len(blocked) if blocked else None)


def earlier_attempts(records: Sequence[AttemptRecord], own_id: str) -> list[AttemptRecord]:
    """The attempts other than `own_id` that trained."""
    return [record for record in attempts_that_trained(records) if record.id != own_id]


@dataclass(frozen=True)
class CadenceChange:
    """One re-derivation of the auto interval: what it is now and what it rests on."""

    interval_s: float
    previous_s: float | None
    cost_s: float | None
    cost_from: str
    mtbf_s: float
    mtbf_from: str
    failures: int
    exposure_s: float
    formula: str

    def as_record(self, step: int | None, at_s: float) -> dict:
        return {"step": step, "at_s": at_s, "interval_s": round(self.interval_s, 3),
                "previous_s": None if self.previous_s is None else round(self.previous_s, 3),
                "cost_s": None if self.cost_s is None else round(self.cost_s, 6), "cost_from": self.cost_from,
                "mtbf_s": round(self.mtbf_s, 3), "mtbf_from": self.mtbf_from, "failures": self.failures,
                "exposure_s": round(self.exposure_s, 3), "formula": self.formula}

    def line(self) -> str:
        was = "" if self.previous_s is None else f" (was {self.previous_s:.3g} s)"
        cost = "C unknown" if self.cost_s is None else f"C={self.cost_s:.3g} s per save ({self.cost_from})"
        return (f"cadence auto: recovery every {self.interval_s:.3g} s{was}: {cost}, M={self.mtbf_s:.3g} s "
                f"({self.mtbf_from}, {self.failures} failures in {self.exposure_s:.0f} s), {self.formula}")


CHANGE_SHARE = 0.1
"""A re-derived interval within this share of the current one is not a change (no line)."""


@dataclass
class AutoSeconds(SinceLastSave):
    """A seconds trigger whose interval is Daly's optimum for the measured C and the run's M,
    bounded by `config`. Starts from `config.min_s` (the safe side) until a save cost is known
    from this attempt or the earlier ones."""

    config: AutoCadenceConfig
    prior: AutoPrior = AutoPrior()
    clock: Callable[[], float] = time.monotonic
    saves: int = 0
    cost_total_s: float = 0.0
    """Blocked seconds of this attempt's recovery saves, summed (a running mean, O(1) a save)."""

    def __post_init__(self) -> None:
        self.started = self.last = self.clock()
        self.current = self.derive(None)

    @property
    def interval_s(self) -> float:
        return self.current.interval_s

    def measured(self, cost_s: float) -> CadenceChange | None:
        """A recovery save blocked the loop `cost_s` seconds: re-derive; the change, if any."""
        self.saves += 1
        self.cost_total_s += max(0.0, cost_s)
        derived = self.derive(self.interval_s)
        if abs(derived.interval_s - self.interval_s) <= CHANGE_SHARE * self.interval_s:
            return None
        self.current = derived
        return derived

    def derive(self, previous: float | None) -> CadenceChange:
        if self.saves:
            cost, cost_from = self.cost_total_s / self.saves, f"this attempt, {self.saves} saves"
        else:
            cost, cost_from = self.prior.cost_s, "earlier attempts"
        mtbf = self.prior.rate.plus(self.clock() - self.started).mtbf(self.config.assume_mtbf_s)
        if cost is None:
            interval, formula = self.config.min_s, "the lower bound until a save is measured"
        else:
            interval, formula = best_interval(cost, mtbf.seconds)
            formula += f", bounded to {self.config.min_s:g}..{self.config.max_s:g} s"
        return CadenceChange(clamp(interval, self.config.min_s, self.config.max_s), previous, cost, cost_from,
                             mtbf.seconds, mtbf.source, mtbf.rate.failures, mtbf.rate.exposure_s, formula)


def memory_prior(records: Sequence[AttemptRecord], own_id: str) -> AutoPrior:
    """What the earlier attempts say for `--memory-every-steps auto`: the same failure rate as
    `auto_prior`, and what a tier-0 save blocked on average (their records' `memory` sums)."""
    earlier = earlier_attempts(records, own_id)
    saves = sum(int(record.memory.get("saves", 0)) for record in earlier)
    blocked = sum(float(record.memory.get("blocked_s", 0.0)) for record in earlier)
    return AutoPrior(failure_rate(map(lifetime, earlier)), blocked / saves if saves else None)


@dataclass(frozen=True)
class StepsChange:
    """One re-derivation of tier 0's auto interval in steps: Daly's seconds (`seconds`, for
    tier 0's C) over the attempt's mean seconds per step."""

    interval_steps: int
    previous_steps: int | None
    step_s: float
    seconds: CadenceChange

    def as_record(self, step: int | None, at_s: float) -> dict:
        return {**self.seconds.as_record(step, at_s), "interval_steps": self.interval_steps,
                "previous_steps": self.previous_steps, "step_s": round(self.step_s, 6)}

    def line(self) -> str:
        was = "" if self.previous_steps is None else f" (was {self.previous_steps})"
        seconds = self.seconds
        cost = "C unknown" if seconds.cost_s is None else f"C={seconds.cost_s:.3g} s per save ({seconds.cost_from})"
        return (f"cadence auto: tier 0 every {self.interval_steps} steps{was}: {seconds.interval_s:.3g} s at "
                f"{self.step_s:.3g} s a step; {cost}, M={seconds.mtbf_s:.3g} s ({seconds.mtbf_from}, "
                f"{seconds.failures} failures in {seconds.exposure_s:.0f} s), {seconds.formula}")


def steps_for(interval_s: float, step_s: float) -> int:
    """The whole steps nearest to `interval_s` at `step_s` a step, at least 1."""
    return max(1, round(interval_s / step_s)) if step_s > 0 else 1


@dataclass
class AutoSteps:
    """`--memory-every-steps auto`: tier 0 every N steps, N = Daly's interval for tier 0's C
    (`seconds`, an AutoSeconds fed tier-0 saves' blocked seconds, bounded to its config's
    seconds) over the attempt's mean seconds per step. N is derived once a step time is known
    (the second step the policy sees) and re-derived after every tier-0 save; until then nothing
    is due. Due when N steps passed since the last tier-0 or durable save (a durable one is as
    new), the restored generation counting as one: the count goes on across a resume, as the
    step triggers' do. Only *when*: rank 0 decides and the ranks share it."""

    seconds: AutoSeconds
    clock: Callable[[], float] = time.monotonic
    interval_steps: int | None = None
    last_step: int | None = None
    origin: tuple[int, float] | None = None
    """(the first step seen, its clock): the attempt's step time is measured from it."""

    def step_s(self, step: int) -> float | None:
        if self.origin is None or step <= self.origin[0]:
            return None
        return (self.clock() - self.origin[1]) / (step - self.origin[0])

    def due(self, step: int) -> tuple[bool, StepsChange | None]:
        """Whether tier 0 saves at `step`, and the first derivation of N (once a step time is known)."""
        if self.origin is None:
            self.origin, self.last_step = (step, self.clock()), step - 1  # the restored generation's step (0: fresh)
            return False, None
        change = None
        if self.interval_steps is None:
            self.seconds.current = self.seconds.derive(None)  # the exposure so far
            change = self.rederive(step)
        return step - self.last_step >= self.interval_steps, change

    def saved(self, step: int) -> None:
        self.last_step = step

    def measured(self, cost_s: float, step: int) -> StepsChange | None:
        """A tier-0 save blocked the loop `cost_s` seconds: re-derive; the change of N, if any
        (its hysteresis is on N: the seconds are re-derived every time)."""
        seconds = self.seconds
        seconds.saves += 1
        seconds.cost_total_s += max(0.0, cost_s)
        seconds.current = seconds.derive(seconds.interval_s)
        return self.rederive(step)

    def rederive(self, step: int) -> StepsChange | None:
        step_s = self.step_s(step)
        if step_s is None:
            return None
        steps = steps_for(self.seconds.interval_s, step_s)
        previous = self.interval_steps
        if previous is not None and abs(steps - previous) <= CHANGE_SHARE * previous:
            return None
        self.interval_steps = steps
        return StepsChange(steps, previous, step_s, self.seconds.current)


@dataclass
class AnyOf:
    policies: list

    def due(self, point: StepPoint) -> bool:
        # Evaluate every policy (no short-circuit) so each sees every step.
        return any([policy.due(point) for policy in self.policies])

    def saved(self) -> None:
        for policy in self.policies:
            policy.saved()

    def state(self) -> dict:
        merged: dict = {}
        for policy in self.policies:
            merged.update(policy.state())
        return merged

    def load_state(self, state: dict) -> None:
        for policy in self.policies:
            policy.load_state(state)


def build_policy(config: CadenceConfig, clock: Callable[[], float] = time.monotonic,
                 prior: AutoPrior | None = None) -> AnyOf:
    """`prior`: what earlier attempts measured, for an auto interval (None: nothing)."""
    policies: list = []
    if config.every_epochs:
        policies.append(EveryEpochs(config.every_epochs))
    if config.every_steps:
        policies.append(EverySteps(config.every_steps))
    if config.every_s:
        policies.append(EverySeconds(config.every_s, clock))
    if config.auto:
        policies.append(AutoSeconds(config.auto, prior or AutoPrior(), clock))
    return AnyOf(policies)


def memory_policy(settings: MemoryTierConfig) -> AnyOf:
    """Tier 0's fixed cadence: every `--memory-every-steps` N steps; nothing with no
    `--memory-dir` (`auto` is `AutoSteps`, built with its prior)."""
    fixed = settings.directory is not None and settings.every_steps
    return AnyOf([EverySteps(settings.every_steps)] if fixed else [])


def auto_trigger(policy: AnyOf) -> AutoSeconds | None:
    return next((p for p in policy.policies if isinstance(p, AutoSeconds)), None)
