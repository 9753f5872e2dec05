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


# ---------------------------------------------------------------- auto: Young/Daly and the policy
import math  # noqa: E402

import pytest  # noqa: E402

from trainer.config import AutoCadenceConfig  # noqa: E402
from trainer.run.cadence import AutoPrior, AutoSeconds, AutoSteps, auto_prior, auto_trigger, memory_prior  # noqa: E402
from trainer.run.records import AttemptRecord  # noqa: E402
from trainer.run.interval import (FailureRate, best_interval, daly_interval, expected_goodput,  # noqa: E402
                                  young_interval)


def test_young_and_daly_agree_when_saves_are_cheap_and_daly_is_the_numeric_optimum():
    assert young_interval(2.0, 3600.0) == pytest.approx(120.0)
    assert daly_interval(2.0, 3600.0) == pytest.approx(120.0, rel=0.02)
    for cost, mtbf in ((2.0, 3600.0), (60.0, 600.0), (30.0, 10_800.0)):
        grid = [cost * 0.05 * k for k in range(1, 4000)]
        numeric = max(grid, key=lambda tau: expected_goodput(tau, cost, 10.0, mtbf))
        # Daly's form sits within 1% of the exact optimum of its own model; Young drifts as C/M grows
        assert expected_goodput(daly_interval(cost, mtbf), cost, 10.0, mtbf) == pytest.approx(
            expected_goodput(numeric, cost, 10.0, mtbf), abs=0.01)
    assert daly_interval(50.0, 20.0) == 20.0 and best_interval(50.0, 20.0)[1].endswith("tau = M")


def test_expected_goodput_falls_with_restart_cost_and_never_overflows():
    assert expected_goodput(100.0, 1.0, 0.0, 1e9) == pytest.approx(100 / 101, rel=1e-3)
    assert expected_goodput(100.0, 1.0, 60.0, 600.0) < expected_goodput(100.0, 1.0, 0.0, 600.0)
    assert expected_goodput(1e6, 1.0, 0.0, 1.0) == 0.0 and expected_goodput(0.0, 1.0, 0.0, 10.0) == 0.0


def test_the_mtbf_to_plan_with_says_where_it_came_from():
    assert FailureRate(4, 400.0).mtbf(assumed_s=50.0).seconds == 100.0  # enough failures: observed wins
    few = FailureRate(1, 400.0).mtbf(assumed_s=50.0)
    assert (few.seconds, few.trusted) == (50.0, True) and few.source.startswith("assumed")
    assert FailureRate(1, 400.0).mtbf().source == "observed from only 1 failure"
    assert FailureRate(2, 400.0).mtbf().source == "observed from only 2 failures"
    none = FailureRate(0, 400.0).mtbf()
    assert (none.seconds, none.trusted) == (400.0, False) and "lower bound" in none.source


def test_auto_starts_at_the_minimum_then_follows_the_measured_cost_within_bounds():
    clock = FakeClock()
    auto = AutoSeconds(AutoCadenceConfig(min_s=5.0, max_s=500.0, assume_mtbf_s=3600.0), AutoPrior(), clock)
    assert auto.interval_s == 5.0 and auto.current.cost_s is None
    clock.now += 5.0
    assert auto.due(points([1])[0])
    auto.saved()
    change = auto.measured(2.0)
    assert change.interval_s == pytest.approx(daly_interval(2.0, 3600.0)) and change.previous_s == 5.0
    assert auto.measured(2.05) is None  # within 10%: no change, no log line
    assert auto.measured(4000.0).interval_s == 500.0  # bounded
    assert not auto.due(points([2])[0])


def test_auto_uses_the_earlier_attempts_cost_and_failures_before_it_measures_its_own():
    clock = FakeClock()
    prior = AutoPrior(FailureRate(4, 4000.0), cost_s=0.5)
    auto = AutoSeconds(AutoCadenceConfig(min_s=1.0, max_s=1e6), prior, clock)
    assert auto.interval_s == pytest.approx(daly_interval(0.5, 1000.0))
    assert auto.current.cost_from == "earlier attempts" and auto.current.failures == 4


def test_auto_prior_from_records_counts_failures_and_leaves_this_attempt_out():
    def rec(id, status, wall, blocked=(), startup=1.0):
        return {"id": id, "status": status, "wall_s": wall, "startup_s": startup,
                "generations_published": [{"name": "g", "blocked_s": b, "at_s": 1.0} for b in blocked]}
    records = [rec("a", "interrupted", 9.0, [0.2, 0.4]), rec("b", "running", None, [0.3]),
               rec("c", "refused", 0.5), rec("d", "completed", 19.0, [0.1]), rec("me", "running", None)]
    records[1]["progress"] = {"every": 8, "points": [[8, 4.0]]}
    prior = auto_prior([AttemptRecord.parse(record) for record in records], "me")
    assert prior.rate == FailureRate(2, 10.0 + 5.0 + 20.0)  # a killed record: its last progress point
    assert prior.cost_s == pytest.approx(0.25)


def test_auto_seconds_state_round_trips_like_every_seconds_and_joins_any_of():
    clock = FakeClock()
    policy = build_policy(CadenceConfig(every_epochs=1, auto=AutoCadenceConfig(min_s=10.0)), clock)
    auto = auto_trigger(policy)
    assert auto is not None and auto_trigger(build_policy(CadenceConfig(every_s=3))) is None
    clock.now += 7
    assert policy.state() == {"secs_since_save": 7.0}
    auto.load_state({"secs_since_save": 9.5})
    clock.now += 0.5
    assert auto.due(points([1])[0]) and not math.isnan(auto.interval_s)


def tier0_auto(clock, prior=AutoPrior(), min_s=1.0, max_s=100.0, mtbf=3600.0) -> AutoSteps:
    return AutoSteps(AutoSeconds(AutoCadenceConfig(min_s, max_s, mtbf), prior, clock), clock)


def test_tier0_auto_counts_daly_seconds_in_steps_at_the_attempts_step_time():
    clock = FakeClock()
    auto = tier0_auto(clock)
    assert auto.due(11) == (False, None)  # the first step seen: no step time yet
    clock.now += 0.1
    due, first = auto.due(12)
    assert not due and first.interval_steps == 10 and first.previous_steps is None  # min 1 s at 0.1 s a step
    assert first.seconds.cost_s is None and first.step_s == pytest.approx(0.1)
    fired = []
    for step in range(13, 40):
        clock.now += 0.1
        if auto.due(step)[0]:
            fired.append(step)
            auto.saved(step)
    assert fired == [20, 30]  # every 10 steps from the restored generation (step 10: the one before the first seen)
    change = auto.measured(0.05, 39)  # a tier-0 save held the loop 0.05 s; 0.1 s a step since step 11
    tau = daly_interval(0.05, 3600.0)
    assert change.seconds.interval_s == pytest.approx(tau) and change.seconds.cost_s == pytest.approx(0.05)
    assert change.interval_steps == round(tau / 0.1) and change.previous_steps == 10
    assert change.as_record(39, 1.0)["interval_steps"] == change.interval_steps
    assert f"tier 0 every {change.interval_steps} steps (was 10)" in change.line()
    assert auto.measured(0.0505, 39) is None  # N within 10 %: no change, no line


def test_tier0_auto_is_bounded_by_its_seconds_and_never_below_one_step():
    clock = FakeClock()
    auto = tier0_auto(clock, min_s=0.5, max_s=2.0)
    auto.due(1)
    clock.now += 1.0
    assert auto.due(2)[1].interval_steps == 1  # 0.5 s at 1 s a step: every step, never 0
    clock.now += 0.01
    auto.due(101)  # now 0.0101 s a step
    assert auto.measured(1e-9, 101).interval_steps == round(0.5 / (1.01 / 100))  # a tiny C: the floor
    assert auto.measured(1000.0, 101).interval_steps == round(2.0 / (1.01 / 100))  # a huge C: the ceiling


def test_tier0_auto_prior_is_the_earlier_attempts_mean_tier0_cost():
    def rec(id, status, wall, memory=None):
        return {"id": id, "status": status, "wall_s": wall, "startup_s": 1.0,
                **({"memory": memory} if memory else {})}
    records = [rec("a", "interrupted", 9.0, {"saves": 3, "save_s": 0.9, "blocked_s": 0.3}),
               rec("b", "completed", 19.0, {"saves": 1, "save_s": 0.5, "blocked_s": 0.5}),
               rec("me", "running", None, {"saves": 5, "save_s": 9.0, "blocked_s": 9.0})]
    prior = memory_prior([AttemptRecord.parse(record) for record in records], "me")
    assert prior.cost_s == pytest.approx(0.8 / 4) and prior.rate == FailureRate(1, 10.0 + 20.0)
    assert memory_prior([AttemptRecord.parse(rec("a", "completed", 5.0))], "me").cost_s is None
    clock = FakeClock()
    auto = tier0_auto(clock, prior, max_s=1e6)
    auto.due(1)
    clock.now += 2.0
    first = auto.due(2)[1]
    assert first.seconds.cost_from == "earlier attempts" and first.seconds.cost_s == pytest.approx(0.2)
    assert first.interval_steps == round(daly_interval(0.2, 3600.0) / 2.0)
