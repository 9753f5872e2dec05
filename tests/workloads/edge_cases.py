"""Workload mistakes and edge cases a new user hits (issue #24), as variants of the toy:

- `--case foreign-tensor`: the optimizer holds a tensor that is not a model parameter (refused
  before the first step, exit 2: it could never be saved);
- `--case uncovered`: a model parameter the optimizer does not cover (legal: trained state
  is saved and resumed exactly);
- `--case lazy-extra`: a `stateful()` tensor that gets its shape at the first step (refused
  at restore, naming the extra and the fix);
- `--case raising-factory`: the factory refuses its options with a ValueError (exit 2).
"""

from __future__ import annotations

import torch

from toy import ToyWorkload  # a sibling module: a workload given by path finds it, as `python file.py` would


class LazyAverage:
    """An average of the weights allocated at the first update: the wrong way to keep extra state."""

    def __init__(self):
        self.average = torch.zeros(0)

    def update(self, model) -> None:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        self.average = weights.clone() if self.average.numel() == 0 else 0.9 * self.average + 0.1 * weights

    def state_dict(self) -> dict:
        return {"average": self.average}

    def load_state_dict(self, state: dict) -> None:
        self.average.copy_(state["average"])


class EdgeCase(ToyWorkload):
    CASES = ("foreign-tensor", "uncovered", "lazy-extra", "raising-factory")

    @staticmethod
    def add_options(group) -> None:
        ToyWorkload.add_options(group)
        group.add_argument("--case", choices=EdgeCase.CASES, default="uncovered")

    def __init__(self, options):
        if options.case == "raising-factory":
            raise ValueError(f"bad --width {options.width}: this case always refuses")
        super().__init__(options)
        self.lazy = LazyAverage()

    def build_optimizer(self, model):
        parameters = list(model.parameters())
        if self.options.case == "foreign-tensor":
            temperature = torch.ones(1, requires_grad=True)  # trained, but not part of the model
            return torch.optim.SGD([*parameters, temperature], lr=self.options.toy_lr, momentum=0.9)
        if self.options.case == "uncovered":
            return torch.optim.SGD(parameters[:2], lr=self.options.toy_lr, momentum=0.9)  # the head stays fixed
        return super().build_optimizer(model)

    def after_step(self, model, optimizer) -> None:
        super().after_step(model, optimizer)
        if self.options.case == "lazy-extra":
            self.lazy.update(model)

    def stateful(self) -> dict:
        extras = super().stateful()
        if self.options.case == "lazy-extra":
            extras["average"] = self.lazy
        return extras
