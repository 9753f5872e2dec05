"""The toy workload with steps that take wall time, not CPU (a sleep), for tests of a frozen or
slow rank (tests/test_peer_silence.py). The sleeps come from the environment, which is not
fingerprinted, so a run without them is the same run, only faster (the tests' baseline):

- `SLOW_STEP_SECS=S`: every step of every rank sleeps S seconds in its loss (a big model's step);
- `SLOW_AT_STEP=N SLOW_EXTRA_SECS=S SLOW_RANK=R`: step N of rank R sleeps S seconds more (a step
  far slower than the others, while the rank lives and beats);
- `SLOW_SAVE_SECS=S SLOW_RANK=R`: rank R's first save after a step sleeps S seconds while its
  state is gathered (a long save).
"""

from __future__ import annotations

import os
import time

from toy import Counter, ToyWorkload  # a sibling module, as `python file.py` would find it


def _env(name: str, default: float = 0.0) -> float:
    return float(os.environ.get(name, default))


SLOW_RANK = int(_env("SLOW_RANK", 1))
THIS_RANK = int(_env("RANK", 0))


class SlowCounter(Counter):
    def __init__(self):
        super().__init__()
        self.save_secs = _env("SLOW_SAVE_SECS")

    def state_dict(self) -> dict:
        if self.save_secs and int(self.steps) > 0:
            time.sleep(self.save_secs)
            self.save_secs = 0.0
        return super().state_dict()


class SlowSteps(ToyWorkload):
    def __init__(self, options):
        super().__init__(options)
        if THIS_RANK == SLOW_RANK:
            self.counter = SlowCounter()

    def loss(self, model, batch):
        step = int(self.counter.steps) + 1
        pause = _env("SLOW_STEP_SECS")
        if step == int(_env("SLOW_AT_STEP", -1)) and THIS_RANK == SLOW_RANK:
            pause += _env("SLOW_EXTRA_SECS")
        if pause:
            time.sleep(pause)
        return super().loss(model, batch)
