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
from typing import Callable, Protocol

from trainer.config import AutoCadenceConfig, CadenceConfig
from trainer.layout import GENERATIONS
from trainer.run.interval import FailureRate, best_interval, clamp
from trainer.run.records import PUBLISHED, attempts_that_trained, failure_rate, lifetime


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


def auto_prior(records: list[dict], own_id: str) -> AutoPrior:
    """What the earlier attempts say for `--recover-every-secs auto`: how many failed over how
    many seconds (the report's M, trainer/run/records.py), and what a recovery save blocked on
    average. `own_id`'s record (this attempt, `running`) is left out; every other `running`
    record is a killed attempt."""
    earlier = [r for r in attempts_that_trained(records) if r.get("id") != own_id]
    blocked = [e["blocked_s"] for r in earlier for e in r.get(PUBLISHED[GENERATIONS], [])
               if isinstance(e.get("blocked_s"), (int, float))]
    return AutoPrior(failure_rate(map(lifetime, earlier)), sum(blocked) / len(blocked) if blocked else None)


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


def auto_trigger(policy: AnyOf) -> AutoSeconds | None:
    return next((p for p in policy.policies if isinstance(p, AutoSeconds)), None)
