"""When to save: small, pure policy objects, one per trigger, combined with `AnyOf`.

A policy sees a `StepPoint` after each optimizer step and answers `due()`. Step and epoch
triggers are pure functions of the step, so they continue unchanged after a resume. The
seconds trigger uses a monotonic clock; its only state ("seconds since the last save") is
carried across processes in the manifest, never in the training state, so a time trigger
decides *when* to save but never changes *what* is trained.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from trainer.config import CadenceConfig


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


@dataclass
class EverySeconds:
    seconds: float
    clock: Callable[[], float] = time.monotonic
    last: float = field(default=None)

    def __post_init__(self) -> None:
        if self.last is None:
            self.last = self.clock()

    def due(self, point: StepPoint) -> bool:
        return self.clock() - self.last >= self.seconds

    def saved(self) -> None:
        self.last = self.clock()

    def state(self) -> dict:
        return {"secs_since_save": round(self.clock() - self.last, 6)}

    def load_state(self, state: dict) -> None:
        self.last = self.clock() - float(state.get("secs_since_save", 0.0))


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


def build_policy(config: CadenceConfig, clock: Callable[[], float] = time.monotonic) -> AnyOf:
    policies: list = []
    if config.every_epochs:
        policies.append(EveryEpochs(config.every_epochs))
    if config.every_steps:
        policies.append(EverySteps(config.every_steps))
    if config.every_s:
        policies.append(EverySeconds(config.every_s, clock))
    return AnyOf(policies)
