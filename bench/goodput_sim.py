"""Goodput against the save interval: a seeded simulation of long runs with failures, using
the trainer's own cadence policies (trainer/run/cadence.py) on a simulated clock.

    python bench/goodput_sim.py --quick
    python bench/goodput_sim.py --cost-s 0.2 --restart-s 3 --step-s 0.01 --mtbf-s 60 --png sim.png
    python bench/goodput_sim.py --scenario llama3-70b --png llama.png
    python bench/goodput_sim.py --replay OUTPUT           # C, R, step time and failures of a real run
    python bench/goodput_sim.py --scenario llama3-70b --tiers --seeds 8   # with and without tier 0

The model (Daly's, so the curve can be checked against trainer/run/interval.py): a run needs
`work` seconds of training, in steps of `step_s`. Every attempt first pays R (start-up,
verify, restore), then trains; a recovery save blocks the loop C seconds and makes the steps
before it durable (the trainer's sync save; its final save too). A failure may strike at any
moment, during a restart or a save as well: the attempt's steps since its last durable save
are lost and the next attempt starts from there. Attempt lifetimes come from an exponential
distribution at rate 1/M (seeded), or replay a real run's attempts in order (`--replay`).

Two goodputs: *time* goodput = useful training seconds / wall seconds (what Daly's formula
predicts), and *step* goodput = useful / computed steps (what `python -m trainer report`
prints as "goodput"). The `auto` policy is the trainer's `--recover-every-secs auto`: each
attempt plans with the failures and save costs of the attempts before it, like the trainer.

The `llama3-70b` scenario: one interruption every 3.1 h (Llama 3: 419 in 54 days on 16,384
H100s). C and R are scaled from the throughput measured here to a 70B-parameter state:
16 bytes per parameter (bf16 weights 2, fp32 master 4, Adam moments 8) = 1.12 TB, written and
read by 2,048 nodes in parallel (547 MB each) at the per-process save and restore throughput
measured here (--save-mb-s, --restore-mb-s), so storage is assumed to scale with the nodes;
R adds the start-up measured here and --reschedule-s (assumed, not measured: rescheduling
and collective initialisation on a cluster). The step time is assumed (30 s); only the ratios
matter for the optimum. The defaults were measured by bench/goodput_validation.py's auto run
on the shared 2-core machine under load (a 25.5 MB state: sync save 0.207 s = 123 MB/s,
verify + restore 0.293 s = 87 MB/s, start-up 9.4 s): a quiet machine is several times faster,
which shortens C and R alike.

`--tiers`: two cadences (`simulate_tiers`). Durable saves at Daly's interval for C and M (C, R)
and a tier-0 save every few steps (C0, R0); a failure restarts from tier 0 when it survived
(`--memory-survives`, 1.0 = always: true for a crashed process, and for a lost node with the
peer replica that the trainer keeps on several nodes, unless the partner node is lost too;
without a peer replica only failures that leave the node up, e.g. 0.22 for Llama 3's share of
interruptions not attributed to hardware) and holds a newer step than the durable
tiers. C0 and R0 are the measured ratios of docs/checkpoint-modes.md "Tiers" applied to C and to
R's read of the state (R's start-up and rescheduling stay); two what-ifs are labelled as such.
The durable interval counts tier-0 save time as training time (the trainer's seconds cadence
reads the wall clock too).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import AutoCadenceConfig, CadenceConfig  # noqa: E402
from trainer.run.cadence import AutoPrior, StepPoint, auto_trigger, build_policy  # noqa: E402
from trainer.run.interval import (FailureRate, daly_interval, expected_goodput,  # noqa: E402
                                  young_interval)

LLAMA3_MTBF_S = 54 * 24 * 3600 / 419
STATE_BYTES_70B = 70e9 * 16
NODES_16K_GPUS = 16_384 // 8


@dataclass(frozen=True)
class Scenario:
    step_s: float
    cost_s: float
    """C: seconds one recovery save blocks the loop."""
    restart_s: float
    """R: seconds before a new attempt trains (start-up, verify, restore)."""
    steps: int
    """Steps of the whole run."""
    mtbf_s: float
    steps_per_epoch: int = 8
    name: str = "custom"
    restore_s: float | None = None
    """The part of R that reads the state back (what a faster tier shortens); None: all of R."""


@dataclass
class Result:
    useful: int = 0
    computed: int = 0
    wall_s: float = 0.0
    failures: int = 0
    saves: int = 0
    train_s: float = 0.0
    """Seconds spent on steps that were computed (kept or not)."""
    intervals: list = field(default_factory=list)
    """The auto policy's intervals, one per re-derivation."""
    memory_saves: int = 0
    memory_restores: int = 0
    """Restarts served by tier 0 (`simulate_tiers`)."""

    def time_goodput(self, scenario: Scenario) -> float:
        return self.useful * scenario.step_s / self.wall_s if self.wall_s else 0.0

    def step_goodput(self) -> float:
        return self.useful / self.computed if self.computed else 0.0


def exponential_lifetimes(mtbf_s: float, seed: int) -> Iterator[float]:
    generator = random.Random(seed)
    while True:
        yield generator.expovariate(1 / mtbf_s)


def replayed_lifetimes(lifetimes: list[float]) -> Iterator[float]:
    """A real run's attempts in order (seconds from process start to its failure), then none."""
    yield from lifetimes
    while True:
        yield math.inf


class SimClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cadence_of(policy: str, scenario: Scenario, auto: AutoCadenceConfig) -> CadenceConfig:
    """`every-epoch` (the trainer's default), `auto`, or a fixed interval in seconds."""
    if policy == "every-epoch":
        return CadenceConfig(every_epochs=1)
    if policy == "auto":
        return CadenceConfig(auto=auto)
    return CadenceConfig(every_s=float(policy))


def simulate(scenario: Scenario, policy: str, lifetimes: Iterator[float],
             auto: AutoCadenceConfig = AutoCadenceConfig(), restarts: Iterator[float] | None = None) -> Result:
    """One run to its last step. `lifetimes`: each attempt's time to failure; `restarts`: each
    attempt's R, when they were measured one by one (else `scenario.restart_s` for all)."""
    clock, result = SimClock(), Result()
    durable, blocked_s, saves = 0, 0.0, 0
    rate = FailureRate(0, 0.0)
    config = cadence_of(policy, scenario, auto)
    while durable < scenario.steps:
        born, dies = clock.now, clock.now + next(lifetimes)

        def fail() -> None:
            nonlocal rate
            clock.now = dies
            result.failures += 1
            rate = FailureRate(rate.failures + 1, rate.exposure_s + (dies - born))

        restart = scenario.restart_s if restarts is None else next(restarts, scenario.restart_s)
        if born + restart > dies:
            fail()
            continue
        clock.now += restart
        cadence = build_policy(config, clock, AutoPrior(rate, blocked_s / saves if saves else None))
        adaptive = auto_trigger(cadence)
        if adaptive is not None:
            result.intervals.append(adaptive.interval_s)
        step, failed = durable, False
        while step < scenario.steps:
            if clock.now + scenario.step_s > dies:
                result.train_s += dies - clock.now
                failed = True
                break
            clock.now += scenario.step_s
            result.train_s += scenario.step_s
            step += 1
            result.computed += 1
            point = StepPoint(step, step // scenario.steps_per_epoch, step % scenario.steps_per_epoch == 0)
            if cadence.due(point) or step == scenario.steps:
                if clock.now + scenario.cost_s > dies:
                    failed = True
                    break
                clock.now += scenario.cost_s
                durable = step
                result.saves += 1
                blocked_s, saves = blocked_s + scenario.cost_s, saves + 1
                cadence.saved()
                if adaptive is not None and (change := adaptive.measured(scenario.cost_s)):
                    result.intervals.append(change.interval_s)
        if failed:
            fail()
        else:
            rate = FailureRate(rate.failures, rate.exposure_s + clock.now - born)
    result.useful, result.wall_s = scenario.steps, clock.now
    return result


def mean_goodputs(scenario: Scenario, policy: str, seeds: list[int], auto: AutoCadenceConfig,
                  lifetimes_of=None) -> dict:
    lifetimes_of = lifetimes_of or (lambda seed: exponential_lifetimes(scenario.mtbf_s, seed))
    runs = [simulate(scenario, policy, lifetimes_of(seed), auto) for seed in seeds]
    intervals = [i for run in runs for i in run.intervals]
    return {"policy": policy, "time_goodput": sum(r.time_goodput(scenario) for r in runs) / len(runs),
            "step_goodput": sum(r.step_goodput() for r in runs) / len(runs),
            "failures": sum(r.failures for r in runs) / len(runs), "saves": sum(r.saves for r in runs) / len(runs),
            "mean_auto_interval_s": sum(intervals) / len(intervals) if intervals else None}


def interval_grid(scenario: Scenario, points: int) -> list[float]:
    """Geometric from about C/4 to 2M (at least one step). Beyond 2M a run rarely lives long
    enough to save, and a long simulated run would take hours of restarts to finish."""
    low = max(scenario.step_s, scenario.cost_s / 4)
    high = max(low * 2, 2 * scenario.mtbf_s)
    return [low * (high / low) ** (k / (points - 1)) for k in range(points)]


def sweep(scenario: Scenario, seeds: list[int], points: int, auto: AutoCadenceConfig, lifetimes_of=None) -> dict:
    """Every fixed interval of the grid, Daly's, `auto` and the default cadence, each over the
    same seeded lifetimes (or `lifetimes_of(seed)`, e.g. one replayed history)."""
    def row(policy: str, tau: float | None = None) -> dict:
        found = mean_goodputs(scenario, policy, seeds, auto, lifetimes_of)
        if tau is None:
            return found
        return {"interval_s": tau, **found,
                "model_goodput": expected_goodput(tau, scenario.cost_s, scenario.restart_s, scenario.mtbf_s)}

    fixed = [row(f"{tau!r}", tau) for tau in interval_grid(scenario, points)]
    daly = daly_interval(scenario.cost_s, scenario.mtbf_s)
    return {"scenario": asdict(scenario), "seeds": len(seeds), "fixed": fixed,
            "best_fixed": max(fixed, key=lambda r: r["time_goodput"]), "auto": row("auto"),
            # an epoch longer than 2M is a run that rarely saves: it would not finish in the simulation
            "every_epoch": row("every-epoch") if scenario.steps_per_epoch * scenario.step_s <= 2 * scenario.mtbf_s
            else None, "daly": row(f"{daly!r}", daly),
            "young_s": young_interval(scenario.cost_s, scenario.mtbf_s)}


def print_sweep(found: dict) -> None:
    s = found["scenario"]
    print(f"scenario {s['name']}: C={s['cost_s']:.4g} s, R={s['restart_s']:.4g} s, step={s['step_s']:.4g} s, "
          f"M={s['mtbf_s']:.4g} s, {s['steps']} steps, {found['seeds']} seeded runs per row")
    print("| policy | interval s | time goodput | step goodput | model (Daly) | failures | saves |")
    print("|---|---|---|---|---|---|---|")
    for row in found["fixed"]:
        print(f"| fixed | {row['interval_s']:.4g} | {row['time_goodput']:.2%} | {row['step_goodput']:.2%} | "
              f"{row['model_goodput']:.2%} | {row['failures']:.1f} | {row['saves']:.1f} |")
    best, auto, daly, epoch = found["best_fixed"], found["auto"], found["daly"], found["every_epoch"]
    auto_interval = "-" if auto["mean_auto_interval_s"] is None else f"{auto['mean_auto_interval_s']:.4g} (mean)"
    print(f"| best fixed | {best['interval_s']:.4g} | {best['time_goodput']:.2%} | {best['step_goodput']:.2%} | "
          f"{best['model_goodput']:.2%} | {best['failures']:.1f} | {best['saves']:.1f} |")
    print(f"| Daly | {daly['interval_s']:.4g} | {daly['time_goodput']:.2%} | {daly['step_goodput']:.2%} | "
          f"{daly['model_goodput']:.2%} | {daly['failures']:.1f} | {daly['saves']:.1f} |")
    print(f"| auto | {auto_interval} | {auto['time_goodput']:.2%} | {auto['step_goodput']:.2%} | - | "
          f"{auto['failures']:.1f} | {auto['saves']:.1f} |")
    if epoch is not None:
        print(f"| every epoch (default) | - | {epoch['time_goodput']:.2%} | {epoch['step_goodput']:.2%} | - | "
              f"{epoch['failures']:.1f} | {epoch['saves']:.1f} |")
    print(f"Young sqrt(2CM) = {found['young_s']:.4g} s; auto - best fixed = "
          f"{(auto['time_goodput'] - best['time_goodput']) * 100:+.2f} points (time goodput)")


def draw(found: dict, path: Path) -> None:
    """Goodput against the interval (log scale): simulated fixed intervals, Daly's model curve,
    the auto policy at its mean interval, and Young's and Daly's intervals."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 6.75), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    fixed = found["fixed"]
    taus = [row["interval_s"] for row in fixed]
    ax.plot(taus, [row["time_goodput"] for row in fixed], "o-", label="simulated, fixed interval (time goodput)")
    ax.plot(taus, [row["step_goodput"] for row in fixed], ".:", color="grey",
            label="simulated, fixed interval (step goodput, as `report` prints)")
    ax.plot(taus, [row["model_goodput"] for row in fixed], "--", color="black", label="Daly's model")
    auto = found["auto"]
    if auto["mean_auto_interval_s"]:
        ax.plot([auto["mean_auto_interval_s"]], [auto["time_goodput"]], "*", markersize=16, color="#c62828",
                label=f"auto (mean interval), {auto['time_goodput']:.1%}")
    ax.axhline(auto["time_goodput"], color="#c62828", alpha=0.4)
    if found["every_epoch"] is not None:
        ax.axhline(found["every_epoch"]["time_goodput"], color="#1565c0", alpha=0.6, linestyle="-.",
                   label=f"every epoch (default), {found['every_epoch']['time_goodput']:.1%}")
    ax.axvline(found["young_s"], color="#2e7d32", linestyle=":", label=f"Young {found['young_s']:.3g} s")
    ax.axvline(found["daly"]["interval_s"], color="#6a1b9a", linestyle=":",
               label=f"Daly {found['daly']['interval_s']:.3g} s")
    ax.set_xscale("log")
    ax.set_xlabel("seconds of training between recovery saves")
    ax.set_ylabel("goodput")
    s = found["scenario"]
    ax.set_title(f"{s['name']}: C={s['cost_s']:.3g} s, R={s['restart_s']:.3g} s, M={s['mtbf_s']:.3g} s, "
                 f"{found['seeds']} seeded runs per point")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="lower center")
    figure.savefig(path, format="png")


def llama3_scenario(save_mb_s: float, restore_mb_s: float, startup_s: float, reschedule_s: float,
                    step_s: float = 30.0) -> Scenario:
    per_node_mb = STATE_BYTES_70B / NODES_16K_GPUS / 1e6
    cost = per_node_mb / save_mb_s
    restart = startup_s + reschedule_s + per_node_mb / restore_mb_s
    steps = int(30 * LLAMA3_MTBF_S / step_s)  # a run 30 failure intervals long
    return Scenario(step_s, cost, restart, steps, LLAMA3_MTBF_S, steps_per_epoch=10 ** 9, name="llama3-70b",
                    restore_s=per_node_mb / restore_mb_s)


# ----------------------------------------------------------------------------- tier 0
TIER0_SAVE_RATIO = 0.7
"""Tier-0 sync save / local-disk sync save, measured (docs/checkpoint-modes.md "Tiers": 0.41 and
0.73 in two 512 MB runs; the higher one taken)."""
TIER0_RESTORE_RATIO = 0.95
"""Tier-0 restore / cold local-disk restore, measured there (0.92, 0.95): CPU-bound here."""
GOAL_RESTORE_RATIO = 0.2 * 2.15
"""What-if: the issue's goal, tier 0 at 0.2x the store, the store at 2.15x the disk (measured)."""
ASYNC_TIER0_SAVE_RATIO = TIER0_SAVE_RATIO * 0.63
"""Async tier-0 saves (`--checkpoint-mode async`), measured on this CPU VM: their loop overhead
0.22-1.14x (median 0.63) a sync tier-0 save's, six `bench/memory_tier_bench.py --quick` runs
(docs/checkpoint-modes.md "Tiers"): the background write shares the loop's two cores."""
ASYNC_SAVE_RATIO = 0.16
"""What-if: an async tier-0 save costs the loop only what it holds it (staging: 0.13-0.40x a
sync tier-0 save measured on CPU, so 0.09-0.28x C; 0.16 within), as on a node whose write runs on
host cores the loop does not need (a GPU node): not measured."""


@dataclass(frozen=True)
class Tier0:
    every_steps: int
    """A tier-0 save every this many steps (0: none, in-place restarts alone)."""
    cost_s: float
    """C0: seconds one tier-0 save blocks the loop."""
    restart_s: float
    """R0: seconds before an attempt restored from tier 0 trains."""
    survives: float = 1.0
    """Share of failures after which tier 0 (or a peer's replica of it) is still readable."""
    read_s: float = 0.0
    """R0's read of the state (the rest of R0 is start-up and rescheduling)."""
    in_place_share: float = 0.0
    """Share of failures a restart in place recovers (a process died, the node lives): torchrun's
    agent restarts the workers where they were, tier 0 survives, nothing is rescheduled."""
    in_place_s: float = 0.0
    """What such a restart costs before the state is read (measured: bench/restart_bench.py)."""


IN_PLACE_SHARE = 0.75
"""DLRover's Flash Checkpoint (intelligent-machine-learning/dlrover, docs/blogs/flash_checkpoint.md):
about 75% of the faults of its production jobs were recovered by restarting the process in place
and reloading from host memory; the rest needed a new node (rescheduled)."""
IN_PLACE_RESTART_S = 3.5
"""R from a kill -9 of one rank to the next step under torchrun --max-restarts, tier 0 serving:
the median of `python bench/restart_bench.py` (3.14, 3.50, 3.91 s) on the 2-core machine, quiet;
9.4 s under load. Imports dominate (1.7-2.0 s), then the heartbeat's naming window (0.9 s)."""


def tier0_of(scenario: Scenario, every_steps: int, save_ratio: float, restore_ratio: float,
             survives: float = 1.0) -> Tier0:
    """C0 and R0 from the durable C and R: R0 is R with its read of the state scaled."""
    read = scenario.restart_s if scenario.restore_s is None else scenario.restore_s
    return Tier0(every_steps, save_ratio * scenario.cost_s, scenario.restart_s - read + restore_ratio * read,
                 survives, restore_ratio * read)


def simulate_tiers(scenario: Scenario, interval_s: float, tier0: Tier0 | None, lifetimes: Iterator[float],
                   seed: int = 0) -> Result:
    """One run with durable saves every `interval_s` of training (C, R) and, with `tier0`, a
    tier-0 save every `tier0.every_steps` steps (C0; skipped on a step where a durable save
    fires, as in the trainer). A failure restarts from the newest generation that is left: tier 0's
    when it survived (seeded draw at `tier0.survives`) and is newer than the durable one (R0),
    else the durable one (R; a lost tier 0 is empty afterwards)."""
    clock, result, draw = SimClock(), Result(), random.Random(seed)
    durable = memory = 0
    restart = scenario.restart_s
    while durable < scenario.steps:
        dies = clock.now + next(lifetimes)
        step = max(durable, memory)
        if clock.now + restart <= dies:
            clock.now += restart
            durable, memory, step = train_until(scenario, interval_s, tier0, (clock, dies, result), step,
                                                (durable, memory))
            if durable >= scenario.steps:
                break
        clock.now = dies
        result.failures += 1
        in_place = tier0 is not None and draw.random() < tier0.in_place_share
        kept = in_place or (tier0 is not None and draw.random() < tier0.survives)
        memory = memory if kept else 0
        restart = tier0.restart_s if kept and memory > durable else scenario.restart_s
        if in_place:  # no rescheduling, no start-up of a new pod: the measured R, then the read
            read = scenario.restart_s if scenario.restore_s is None else scenario.restore_s
            restart = tier0.in_place_s + (tier0.read_s if memory > durable else read)
        result.memory_restores += kept and memory > durable
    result.useful, result.wall_s = scenario.steps, clock.now
    return result


def train_until(scenario: Scenario, interval_s: float, tier0: Tier0 | None, timing: tuple, step: int,
                saved: tuple[int, int]) -> tuple[int, int, int]:
    """One attempt's training from `step` until it fails (`dies`) or ends: the durable and tier-0
    steps it leaves, and its last step."""
    clock, dies, result = timing
    durable, memory = saved
    cadence = build_policy(CadenceConfig(every_s=interval_s), clock, AutoPrior())
    while step < scenario.steps:
        if clock.now + scenario.step_s > dies:
            result.train_s += dies - clock.now
            return durable, memory, step
        clock.now += scenario.step_s
        result.train_s += scenario.step_s
        step += 1
        result.computed += 1
        if cadence.due(StepPoint(step, 0, False)) or step == scenario.steps:
            if clock.now + scenario.cost_s > dies:
                return durable, memory, step
            clock.now, durable = clock.now + scenario.cost_s, step
            result.saves += 1
            cadence.saved()
        elif tier0 is not None and tier0.every_steps and step % tier0.every_steps == 0:
            if clock.now + tier0.cost_s > dies:
                return durable, memory, step
            clock.now, memory = clock.now + tier0.cost_s, step
            result.memory_saves += 1
    return durable, memory, step


def compare_tiers(scenario: Scenario, seeds: list[int], every_steps: list[int], survives: float = 1.0,
                  in_place: tuple[float, float] = (0.0, 0.0)) -> dict:
    """Goodput without tier 0 and with it, at the measured ratios and at two labelled what-ifs,
    the durable cadence at Daly's interval throughout (it keeps its cadence)."""
    interval = daly_interval(scenario.cost_s, scenario.mtbf_s)

    def row(case: str, tier0: Tier0 | None) -> dict:
        runs = [simulate_tiers(scenario, interval, tier0, exponential_lifetimes(scenario.mtbf_s, seed), seed)
                for seed in seeds]
        mean = lambda value: sum(map(value, runs)) / len(runs)  # noqa: E731
        return {"case": case, "every_steps": tier0 and tier0.every_steps or None, "c0_s": tier0 and tier0.cost_s,
                "r0_s": tier0 and tier0.restart_s, "time_goodput": mean(lambda r: r.time_goodput(scenario)),
                "step_goodput": mean(Result.step_goodput), "failures": mean(lambda r: r.failures),
                "memory_restores": mean(lambda r: r.memory_restores)}

    cases = {"tier 0, ratios measured here": (TIER0_SAVE_RATIO, TIER0_RESTORE_RATIO),
             "async tier-0 saves, ratios measured here": (ASYNC_TIER0_SAVE_RATIO, TIER0_RESTORE_RATIO),
             "what-if: restore at the goal (0.2x the store)": (TIER0_SAVE_RATIO, GOAL_RESTORE_RATIO),
             "what-if: goal restore, async save costing only its staging": (ASYNC_SAVE_RATIO, GOAL_RESTORE_RATIO)}
    rows = [row("without tier 0", None)] + [
        row(case, tier0_of(scenario, n, save, restore, survives)) for case, (save, restore) in cases.items()
        for n in every_steps]
    share, restart_s = in_place
    if share:  # the same tier 0, and a share of failures restarted in place at the measured R
        rows += [row(f"tier 0 + in-place restarts ({share:.0%} of failures, R {restart_s:.3g} s)",
                     replace(tier0_of(scenario, n, TIER0_SAVE_RATIO, TIER0_RESTORE_RATIO, survives),
                             in_place_share=share, in_place_s=restart_s)) for n in every_steps]
        rows.append(row(f"in-place restarts alone ({share:.0%}, from the durable tier)",
                        Tier0(0, 0.0, scenario.restart_s, 0.0, 0.0, share, restart_s)))  # 0: no tier-0 saves
    return {"scenario": asdict(scenario), "seeds": len(seeds), "interval_s": interval, "survives": survives,
            "rows": rows}


def print_tiers(found: dict) -> None:
    s = found["scenario"]
    print(f"scenario {s['name']}: C={s['cost_s']:.4g} s, R={s['restart_s']:.4g} s, step={s['step_s']:.4g} s, "
          f"M={s['mtbf_s']:.4g} s; durable saves every {found['interval_s']:.4g} s (Daly); tier 0 survives "
          f"{found['survives']:.0%} of failures; {found['seeds']} seeded runs per row")
    print("| case | tier 0 every | C0 s | R0 s | time goodput | step goodput | failures | from tier 0 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in found["rows"]:
        print(f"| {r['case']} | {cell(r['every_steps'], '{} steps')} | {cell(r['c0_s'], '{:.3g}')} | "
              f"{cell(r['r0_s'], '{:.4g}')} | {r['time_goodput']:.2%} | {r['step_goodput']:.2%} | "
              f"{r['failures']:.1f} | {r['memory_restores']:.1f} |")


def cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def replay_scenario(run: Path) -> tuple[Scenario, list[float]]:
    """C, R, the step time and the attempts' lifetimes (start-up + wall) of a real run."""
    from trainer.inspect.listing import run_report
    from trainer.inspect.report import advise, seconds_per_step
    from trainer.run.records import FAILURES

    report = run_report(run)
    advice = advise(report)
    trained = [row for row in report.rows if row.outcome != "refused"]
    per_step = [(seconds_per_step(row), row.computed) for row in trained if seconds_per_step(row)]
    step_s = sum(s * n for s, n in per_step) / sum(n for _, n in per_step)
    lifetimes = [(row.startup_s or 0.0) + (row.wall_s or 0.0) for row in trained if row.outcome in FAILURES]
    return Scenario(step_s, advice.cost_s or 0.0, advice.restart_s or 0.0, report.totals.useful,
                    advice.mtbf_s or math.inf, name=f"replay of {run}"), lifetimes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("custom", "llama3-70b"), default="custom")
    parser.add_argument("--step-s", type=float, default=0.01)
    parser.add_argument("--cost-s", type=float, default=0.2, help="C (custom)")
    parser.add_argument("--restart-s", type=float, default=3.0, help="R (custom)")
    parser.add_argument("--mtbf-s", type=float, default=60.0, help="M (custom)")
    parser.add_argument("--work-s", type=float, default=1800.0, help="training seconds the run needs (custom)")
    parser.add_argument("--save-mb-s", type=float, default=123.0,
                        help="llama3-70b: per-process save throughput measured here (MB/s)")
    parser.add_argument("--restore-mb-s", type=float, default=87.0,
                        help="llama3-70b: per-process restore throughput measured here (MB/s)")
    parser.add_argument("--startup-s", type=float, default=9.4, help="llama3-70b: start-up measured here")
    parser.add_argument("--reschedule-s", type=float, default=300.0,
                        help="llama3-70b: assumed rescheduling and collective initialisation")
    parser.add_argument("--replay", type=Path, help="a run directory: its C, R, step time and failures")
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--points", type=int, default=16)
    parser.add_argument("--auto-min-s", type=float, default=None, help="auto's lower bound (default C)")
    parser.add_argument("--auto-max-s", type=float, default=None, help="auto's upper bound (default 10 M)")
    parser.add_argument("--quick", action="store_true", help="8 seeds, 8 intervals, a 10-minute run of 0.05 s steps")
    parser.add_argument("--tiers", action="store_true",
                        help="instead of the sweep: goodput with and without tier 0 (durable saves at Daly's "
                             "interval, tier-0 saves every --memory-every-steps)")
    parser.add_argument("--memory-every-steps", type=int, nargs="+", default=[1, 2, 5],
                        help="--tiers: tier-0 cadences to simulate (steps)")
    parser.add_argument("--memory-survives", type=float, default=1.0,
                        help="--tiers: share of failures after which tier 0 (or a peer replica) is readable")
    parser.add_argument("--in-place-share", type=float, default=IN_PLACE_SHARE,
                        help="with --tiers: share of failures restarted in place (torchrun --max-restarts); default: "
                             "DLRover's report, about 75%% of faults recovered by restarting the process in place")
    parser.add_argument("--in-place-restart-s", type=float, default=IN_PLACE_RESTART_S,
                        help="R of a restart in place before the state is read (bench/restart_bench.py, measured here)")
    parser.add_argument("--png", type=Path, help="also draw goodput against the interval into this PNG")
    parser.add_argument("--dir", type=Path, help="unused: nothing is written but --png and --json")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.points, args.work_s, args.step_s = 8, 8, 600.0, 0.05
    lifetimes_of = None
    if args.replay:
        scenario, lifetimes = replay_scenario(args.replay)
        lifetimes_of = lambda seed: replayed_lifetimes(lifetimes)  # noqa: E731 - one history, no seeds
        args.seeds = 1
    elif args.scenario == "llama3-70b":
        scenario = llama3_scenario(args.save_mb_s, args.restore_mb_s, args.startup_s, args.reschedule_s)
    else:
        scenario = Scenario(args.step_s, args.cost_s, args.restart_s, int(args.work_s / args.step_s), args.mtbf_s)
    auto = AutoCadenceConfig(min_s=args.auto_min_s or max(scenario.cost_s, scenario.step_s),
                             max_s=args.auto_max_s or 10 * min(scenario.mtbf_s, 1e9))
    seeds = list(range(args.seeds))
    if args.tiers:
        found = compare_tiers(scenario, seeds, args.memory_every_steps, args.memory_survives,
                              (args.in_place_share, args.in_place_restart_s))
        print_tiers(found)
        if args.json:
            args.json.write_text(json.dumps(found, indent=2))
        return 0
    found = sweep(scenario, seeds, args.points, auto, lifetimes_of)
    print_sweep(found)
    if args.png:
        draw(found, args.png)
        print(f"goodput curve written to {args.png}")
    if args.json:
        args.json.write_text(json.dumps(found, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
