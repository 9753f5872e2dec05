"""Cadence policies are pure: tested with a fake clock, no disk."""

from __future__ import annotations

from trainer.run.cadence import AnyOf, EveryEpochs, EverySeconds, EverySteps, StepPoint, build_policy
from trainer.config import CadenceConfig


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def points(steps, per_epoch=8):
    return [StepPoint(s, s // per_epoch, s % per_epoch == 0) for s in steps]


def test_every_epochs_fires_on_completed_epochs_only():
    policy = EveryEpochs(2)
    assert [p.step for p in points(range(1, 41)) if policy.due(p)] == [16, 32]


def test_every_steps_is_aligned_to_the_global_step():
    policy = EverySteps(5)
    assert [p.step for p in points(range(1, 23)) if policy.due(p)] == [5, 10, 15, 20]


def test_every_seconds_uses_the_clock_and_resets_on_save():
    clock = FakeClock()
    policy = EverySeconds(10, clock)
    point = points([1])[0]
    assert not policy.due(point)
    clock.now += 9.99
    assert not policy.due(point)
    clock.now += 0.01
    assert policy.due(point)
    policy.saved()
    assert not policy.due(point)


def test_seconds_state_round_trips_across_processes():
    clock = FakeClock()
    policy = EverySeconds(10, clock)
    clock.now += 7
    state = policy.state()
    assert state == {"secs_since_save": 7.0}
    later = FakeClock()
    later.now = 5000.0  # another process: a different monotonic origin
    resumed = EverySeconds(10, later)
    resumed.load_state(state)
    later.now += 2.9
    assert not resumed.due(points([1])[0])
    later.now += 0.2
    assert resumed.due(points([1])[0])


def test_any_of_fires_when_any_fires_and_informs_all():
    clock = FakeClock()
    seconds = EverySeconds(60, clock)
    policy = AnyOf([EveryEpochs(1), EverySteps(3), seconds])
    fired = [p.step for p in points(range(1, 10)) if policy.due(p)]
    assert fired == [3, 6, 8, 9]
    clock.now += 61
    assert policy.due(points([1])[0])
    policy.saved()
    assert not seconds.due(points([1])[0])


def test_build_policy_from_config_and_empty_never_fires():
    assert not any(build_policy(CadenceConfig()).due(p) for p in points(range(1, 100)))
    policy = build_policy(CadenceConfig(every_epochs=1, every_steps=5))
    assert [p.step for p in points(range(1, 17)) if policy.due(p)] == [5, 8, 10, 15, 16]
