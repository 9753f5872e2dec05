"""How often to save: the checkpoint-interval models of Young (1974) and Daly (2006), and the
failure rate a run's own attempt records give. Pure arithmetic, no I/O and no clock: the
`auto` cadence (trainer/run/cadence.py), the report's advice (trainer/inspect/report.py) and
the simulator (bench/goodput_sim.py) all use these same functions.

Symbols (Daly's): C, seconds the loop is blocked by one save; R, seconds a restart costs
before training continues (process start-up, verify, download, restore); M, the mean time
between failures; τ, seconds of training between two saves.

- Young: τ = √(2·C·M), first order in C/M.
- Daly's higher-order form: τ = √(2·C·M)·[1 + ⅓·√(C/2M) + ⅑·(C/2M)] − C while C < 2M, else
  τ = M. It matters once C is not ≪ M.
- Expected goodput (Daly's model: exponential failures that may strike during training,
  saves and restarts alike): τ / (M·e^{R/M}·(e^{(τ+C)/M} − 1)), the share of wall time spent
  on training that is kept. R lowers the goodput of every interval alike, so it does not
  move the best one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_FAILURES = 3
"""Fewer failures than this and the observed interval is a guess: `--assume-mtbf-secs` wins."""


def young_interval(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum; `mtbf_s` itself once a save costs 2M or more."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


def expected_goodput(interval_s: float, cost_s: float, restart_s: float, mtbf_s: float) -> float:
    """Share of wall time that is training kept, saving every `interval_s` (Daly's model)."""
    if interval_s <= 0 or mtbf_s <= 0:
        return 0.0
    exponent = (interval_s + cost_s) / mtbf_s
    if exponent > 700 or restart_s / mtbf_s > 700:  # overflow: nothing is ever kept
        return 0.0
    return interval_s / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1(exponent))


def clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


@dataclass(frozen=True)
class FailureRate:
    """What the records say about failures: how many, over how many seconds of attempts."""

    failures: int
    exposure_s: float
    """Seconds the attempts ran (start-up included), during which a failure could strike."""

    def mtbf(self, assumed_s: float | None = None) -> "Mtbf":
        """The M to plan with: observed with MIN_FAILURES or more; else the assumed one
        (`--assume-mtbf-secs`) if given; else the observed one with its few failures, or, with
        none, the exposure itself (no failure in T seconds: plan as if one came next)."""
        observed = self.exposure_s / max(self.failures, 1)
        if self.failures >= MIN_FAILURES or assumed_s is None:
            source = "observed" if self.failures >= MIN_FAILURES else \
                f"observed from only {self.failures} failure{'' if self.failures == 1 else 's'}" if self.failures \
                else "no failure yet (lower bound)"
            return Mtbf(observed, source, self)
        return Mtbf(assumed_s, "assumed (--assume-mtbf-secs)", self)

    def plus(self, seconds: float) -> "FailureRate":
        """The same history, exposed `seconds` longer without a failure (a live attempt)."""
        return FailureRate(self.failures, self.exposure_s + seconds)


@dataclass(frozen=True)
class Mtbf:
    seconds: float
    source: str
    rate: FailureRate

    @property
    def trusted(self) -> bool:
        return self.rate.failures >= MIN_FAILURES or self.source.startswith("assumed")


def best_interval(cost_s: float, mtbf_s: float) -> tuple[float, str]:
    """The interval to use and the formula that gave it."""
    if cost_s <= 0:
        return 0.0, "no save cost measured"
    if cost_s >= 2 * mtbf_s:
        return mtbf_s, "Daly, C >= 2M: tau = M"
    return daly_interval(cost_s, mtbf_s), "Daly's higher-order form"
