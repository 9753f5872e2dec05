"""bench/goodput_sim.py: the simulator is pure and seeded, so its numbers are checked exactly
on a hand-computed history and against Daly's closed form on long runs; the two-cadence (tier 0)
model on hand-computed histories. Cost: ~2 s."""

from __future__ import annotations

import sys

import pytest

from support.cli import REPO

sys.path.insert(0, str(REPO / "bench"))

from goodput_sim import (Scenario, Tier0, compare_tiers, draw, exponential_lifetimes,  # noqa: E402
                         llama3_scenario, replayed_lifetimes, simulate, simulate_tiers, sweep, tier0_of)

from trainer.config import AutoCadenceConfig  # noqa: E402
from trainer.run.interval import daly_interval, expected_goodput  # noqa: E402


def test_a_replayed_failure_costs_what_is_computed_by_hand():
    # 10 steps of 1 s, saves cost 0.5 s and come 3 s of training apart, a restart costs 1 s;
    # the first attempt dies 5 s in: it saved step 3 at 4.5 s and was killed in step 4.
    scenario = Scenario(step_s=1.0, cost_s=0.5, restart_s=1.0, steps=10, mtbf_s=10.0)
    result = simulate(scenario, "3.0", replayed_lifetimes([5.0]))
    assert (result.failures, result.computed, result.useful, result.saves) == (1, 10, 10, 4)
    assert result.wall_s == pytest.approx(5.0 + 1 + 3 + 0.5 + 3 + 0.5 + 1 + 0.5)
    assert result.time_goodput(scenario) == pytest.approx(10 / 14.5)
    assert result.step_goodput() == 1.0
    # the same history with each attempt's own R (as measured one by one): the second took 3 s
    measured = simulate(scenario, "3.0", replayed_lifetimes([5.0]), restarts=iter([1.0, 3.0]))
    assert measured.wall_s == pytest.approx(result.wall_s + 2.0) and measured.computed == 10


def test_without_failures_the_cost_is_restart_and_saves_only():
    scenario = Scenario(step_s=0.5, cost_s=0.25, restart_s=2.0, steps=64, mtbf_s=1e9)
    result = simulate(scenario, "every-epoch", replayed_lifetimes([]))
    assert result.saves == 8 and result.wall_s == pytest.approx(2.0 + 32 + 8 * 0.25)


def test_long_simulated_runs_follow_dalys_model_and_are_seeded():
    scenario = Scenario(step_s=1.0, cost_s=10.0, restart_s=60.0, steps=30_000, mtbf_s=600.0)
    tau = daly_interval(10.0, 600.0)
    runs = [simulate(scenario, f"{tau!r}", exponential_lifetimes(600.0, seed)) for seed in range(6)]
    simulated = sum(r.time_goodput(scenario) for r in runs) / len(runs)
    assert simulated == pytest.approx(expected_goodput(tau, 10.0, 60.0, 600.0), abs=0.02)
    again = simulate(scenario, f"{tau!r}", exponential_lifetimes(600.0, 0))
    assert again.wall_s == runs[0].wall_s  # same seed, same run


def test_auto_is_close_to_the_best_fixed_interval_and_beats_the_default(tmp_path):
    scenario = Scenario(step_s=2.0, cost_s=5.0, restart_s=30.0, steps=6_000, mtbf_s=900.0, steps_per_epoch=200)
    found = sweep(scenario, list(range(5)), 8, AutoCadenceConfig(min_s=5.0, max_s=9000.0))
    best, auto = found["best_fixed"], found["auto"]
    assert auto["time_goodput"] > found["every_epoch"]["time_goodput"]
    assert auto["time_goodput"] >= best["time_goodput"] - 0.01
    draw(found, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000


def test_two_cadences_restart_from_tier0_when_it_survived_as_computed_by_hand():
    # 10 steps of 1 s; durable saves (C 0.5, R 1) every 3 s, tier 0 (C0 0.1, R0 0.25) every 2 steps.
    # The first attempt dies at 6 s: durable step 3 (at 4.6 s), tier-0 steps 2 and 4 (at 5.7 s).
    scenario = Scenario(step_s=1.0, cost_s=0.5, restart_s=1.0, steps=10, mtbf_s=10.0)
    tier0 = Tier0(every_steps=2, cost_s=0.1, restart_s=0.25)
    kept = simulate_tiers(scenario, 3.0, tier0, replayed_lifetimes([6.0]))
    assert (kept.failures, kept.memory_restores, kept.computed, kept.saves, kept.memory_saves) == (1, 1, 10, 3, 4)
    assert kept.wall_s == pytest.approx(6.0 + 0.25 + 6 * 1.0 + 2 * 0.1 + 2 * 0.5)
    # without tier 0: back to step 3 at R, steps 4-5 computed twice (the trainer's sync model above)
    plain = simulate_tiers(scenario, 3.0, None, replayed_lifetimes([6.0]))
    assert (plain.failures, plain.memory_restores, plain.computed, plain.saves) == (1, 0, 11, 4)
    assert plain.wall_s == pytest.approx(6.0 + 1.0 + 7 * 1.0 + 3 * 0.5)
    assert plain.wall_s == simulate(scenario, "3.0", replayed_lifetimes([6.0])).wall_s
    # tier 0 lost with the node (no peer replica): the durable tier serves, at R
    lost = simulate_tiers(scenario, 3.0, Tier0(2, 0.1, 0.25, survives=0.0), replayed_lifetimes([6.0]))
    assert (lost.memory_restores, lost.computed) == (0, 11)


def test_tier0_figures_come_from_the_measured_ratios_and_are_compared_at_one_durable_cadence():
    scenario = llama3_scenario(123.0, 87.0, 9.4, 300.0)
    tier0 = tier0_of(scenario, 5, 0.7, 0.5)
    assert tier0.cost_s == pytest.approx(0.7 * scenario.cost_s)
    assert tier0.restart_s == pytest.approx(scenario.restart_s - 0.5 * scenario.restore_s)
    short = Scenario(step_s=1.0, cost_s=2.0, restart_s=20.0, steps=3_000, mtbf_s=300.0, restore_s=10.0)
    found = compare_tiers(short, [0, 1], [5])
    cases = [row["case"] for row in found["rows"]]
    assert cases[0] == "without tier 0" and len(cases) == 5 and sum("what-if" in case for case in cases) == 2
    best = max(found["rows"], key=lambda row: row["time_goodput"])
    assert best["case"] != "without tier 0" and best["memory_restores"] > 0


def test_a_failure_restarted_in_place_costs_the_measured_restart_and_tier0s_read_only():
    """One failure, restarted in place: no rescheduling, no new pod; it pays the in-place R and
    tier 0's read instead of R. The `--tiers` table has the in-place rows, worth more than none."""
    scenario = Scenario(step_s=1.0, cost_s=0.5, restart_s=100.0, steps=10, mtbf_s=10.0, restore_s=10.0)
    tier0 = Tier0(every_steps=1, cost_s=0.0, restart_s=95.0, read_s=5.0, in_place_share=1.0, in_place_s=2.0)
    rescheduled = simulate_tiers(scenario, 1000.0, Tier0(1, 0.0, 95.0, read_s=5.0), replayed_lifetimes([104.5]))
    in_place = simulate_tiers(scenario, 1000.0, tier0, replayed_lifetimes([104.5]))
    # the first attempt pays R (100 s), trains steps 1..4 with a free tier-0 save each, dies at 104.5
    assert rescheduled.wall_s == pytest.approx(104.5 + 95.0 + 6 * 1.0 + 0.5)
    assert in_place.wall_s == pytest.approx(104.5 + 2.0 + 5.0 + 6 * 1.0 + 0.5)
    found = compare_tiers(Scenario(step_s=1.0, cost_s=2.0, restart_s=200.0, steps=3_000, mtbf_s=300.0, restore_s=10.0),
                          [0, 1], [5], in_place=(0.75, 5.0))
    rows = {row["case"]: row for row in found["rows"]}
    with_in_place = rows["tier 0 + in-place restarts (75% of failures, R 5 s)"]
    assert with_in_place["time_goodput"] > rows["without tier 0"]["time_goodput"] + 0.05
